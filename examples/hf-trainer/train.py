"""A tiny Hugging Face Trainer job for relaunch: save_steps, and a save on a reclaim notice.

The model is a 2-layer GPT-2 built from a config (nothing is downloaded) that learns short
arithmetic token sequences; it runs on a CPU in seconds, and as it is on a GPU. What saves it on
a notice:

- transformers' own JIT checkpoint (`enable_jit_checkpoint=True`, transformers >= 5): on SIGTERM
  (the guard's run.stop.signal) it waits 3 s, saves `checkpoint-N` at the current step and
  stops training.
- `relaunch.train.TrainerCallback()`: leaves that SIGTERM to transformers when the JIT
  checkpoint is on; otherwise (`--no-jit`, an older transformers, another run.stop.signal, or
  only the guard's notice record) it saves `checkpoint-N` at the end of the step and stops.
  Either way `stop.requested()` tells this script that training stopped on a notice (and the
  callback's `stopping`, on a rank the signal did not reach). Under torchrun every rank saves and
  stops at the step they agree on (the callback's save: the JIT checkpoint is per process).

`--resume_from_checkpoint "{{ checkpoint }}"` is `trainer.train(resume_from_checkpoint=...)`; an empty value is
a fresh start. Every logged step prints `step N loss X grad_norm Y` (relaunch drill reads it
with run.metrics); a notice ends with `stopped at step N`, the end of the run with `done step N`.
Dropout is off, so a resumed run repeats the uninterrupted one's losses.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
from pathlib import Path

VOCAB, LENGTH, SEQUENCES = 64, 16, 512


def say(line: str) -> None:
    """One write per line. Under torchrun every rank shares the log, and with PYTHONUNBUFFERED
    print() writes a line's text and its newline apart: two ranks' lines would splice into one."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True, help="where checkpoint-N/ go (checkpoint.dir)")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--save_steps", type=int, default=10)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--resume_from_checkpoint", default="", help="a checkpoint-N folder; empty: fresh start")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps (a demo's pace)")
    parser.add_argument("--no-jit", action="store_true", help="leave transformers' JIT checkpoint off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--final", default="", help="write the sha256 of the final weights here")
    args = parser.parse_args()
    resume = args.resume_from_checkpoint
    if resume and not (Path(resume) / "trainer_state.json").is_file():
        print(f"error: --resume_from_checkpoint {resume}: not a Trainer checkpoint (no trainer_state.json)",
              file=sys.stderr)
        return 2

    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from relaunch import train as relaunch_train

    if torch.distributed.is_available():
        import torch.distributed.nn  # noqa: F401  (before the Trainer starts a process group: see the end)
    transformers.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    # what the JIT checkpoint does ("Saving JIT checkpoint at step N") goes to the log
    transformers.logging.get_logger("transformers.trainer_jit_checkpoint").setLevel("INFO")
    data = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (SEQUENCES, 1), generator=data)
    strides = torch.randint(1, 4, (SEQUENCES, 1), generator=data)
    tokens = (starts + strides * torch.arange(LENGTH)) % VOCAB

    class Sequences(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return SEQUENCES

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": tokens[i], "labels": tokens[i]}

    class Report(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                say(f"step {state.global_step} loss {logs['loss']:.6f} grad_norm {logs['grad_norm']:.6f}")

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(cli.sleep)

    cli = args
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=False)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size, learning_rate=3e-3,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=2, logging_steps=1,
        enable_jit_checkpoint=not args.no_jit, report_to="none", disable_tqdm=True, seed=args.seed,
        dataloader_num_workers=0, dataloader_pin_memory=False)
    relaunch_callback = relaunch_train.TrainerCallback()
    trainer = Trainer(model=model, args=training, train_dataset=Sequences(),
                      callbacks=[Report(), relaunch_callback])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)   # Report prints the steps
    say(f"resumed from {resume}" if resume else "fresh start")
    stop = relaunch_train.install()
    trainer.train(resume_from_checkpoint=resume or None)
    if stop.requested() or relaunch_callback.stopping:   # the signal here, or on another rank
        say(f"stopped at step {trainer.state.global_step}")
    else:
        if args.final:
            weights = trainer.model.state_dict()
            digest = hashlib.sha256(b"".join(weights[k].detach().cpu().numpy().tobytes() for k in sorted(weights)))
            Path(args.final).expanduser().write_text(digest.hexdigest() + "\n")
        say(f"done step {trainer.state.global_step}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Under torchrun the Trainer leaves its process group up, and gloo's worker threads with
        # it. One of them letting go of the last collective's tensors once Python has begun to shut
        # down aborts the process ("terminate called without an active exception") after a good
        # save, and torchrun reports the run failed. So the group goes before the script returns:
        # - torch.distributed.nn is imported at the top, before the group starts (imported later,
        #   by DDP, it holds the group in its functions' default arguments for good);
        # - the trainer goes (its DDP model holds the group), while `group` still holds it: the
        #   model's last hold would end the group with the interpreter's lock held, and a worker
        #   thread waiting for that lock deadlocks with it;
        # - `del group`, the last hold, ends the group without that lock and joins its threads.
        group = torch.distributed.group.WORLD
        torch.distributed.destroy_process_group()
        del trainer, model
        gc.collect()
        del group
    return 0


if __name__ == "__main__":
    sys.exit(main())
