"""A trainer's own resume of an older save reaches the same answer as `up --checkpoint`
(tests/test_rollback.py): relaunch.train's Checkpointer (`restore`), transformers' Trainer with
relaunch's callback (`resume_from_checkpoint`) and Lightning with relaunch's callback (`ckpt_path`).

Each trains to step 30 saving every 2 (the Checkpointer and the Trainer keep their newest 2), then
resumes from its save of step 28 and saves 29. The answer, read as relaunch reads it (its listing of
the folder, its layout, the lineage file, and the store's records of the old saves once the branch
reaches it): the newest is step 29, the branch resumed from 28, step 30 is set aside (kept in
`.relaunch-aside/`, never listed) and the store sets its record of 30 aside too. Without the
branch, the Trainer's rotation keeps 30 over the new save's predecessor, and in every layout
relaunch calls 30 (the higher step) the newest. The Trainer and Lightning run in a child process
(their signal handlers stay out of this one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from relaunch import train  # noqa: E402
from relaunch.layouts import LISTING_COMMAND, complete_checkpoints, parse_listing  # noqa: E402
from relaunch.manifest import Branch, CheckpointRecord, FileRecord, StoreManifest  # noqa: E402
from test_checkpointer import Job  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ANSWER = {"newest": 29, "resumed": 28, "aside": [30], "store newest": 29, "store aside": [30]}

PRELUDE = """\
import sys
import torch
from relaunch import train as relaunch_train
out, steps, every, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
stop = relaunch_train.StopRequest(signals=["USR2"], notice_file="")
torch.manual_seed(0)
"""

TRAINER = PRELUDE + """\
from transformers import Trainer, TrainingArguments

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": ((self.lin(x) - y) ** 2).mean()}

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return {"x": x, "y": x.sum(0, keepdim=True)}

args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, save_strategy="steps",
                         save_steps=every, save_total_limit=2, logging_steps=1000, report_to="none",
                         disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
trainer = Trainer(model=Tiny(), args=args, train_dataset=Data(), callbacks=[relaunch_train.TrainerCallback(stop)])
trainer.train(resume_from_checkpoint=resume or None)
"""

LIGHTNING = PRELUDE + """\
import lightning.pytorch as pl

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, index):
        x, y = batch
        return ((self.lin(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1)),
                                   batch_size=4)
saves = pl.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=every, save_top_k=-1)
trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[saves, relaunch_train.lightning_callback()(stop)])
trainer.fit(Tiny(), data, ckpt_path=resume or None)
"""


def run_child(script: str, tmp: Path, *args: object) -> str:
    path = tmp / "train_child.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RELAUNCH_NOTICE", "RELAUNCH_STOP_SIGNAL", "RELAUNCH_STARTED"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def answer(folder: Path, layout: str) -> dict[str, object]:
    """What relaunch makes of the folder: its newest, the branch in its lineage file, and what a store
    holding the old run's last saves (26, 28, 30, written before the branch) sets aside once the
    branch reaches it, then with the new saves added."""
    out = subprocess.run(LISTING_COMMAND.format(dir=str(folder)), shell=True, check=True, capture_output=True).stdout
    listed = complete_checkpoints(parse_listing(out), layout)
    [line] = (folder / train.ASIDE_DIR / train.LINEAGE_FILE).read_text().splitlines()
    branch = Branch.from_dict(json.loads(line))
    for name in branch.aside:
        assert (folder / train.ASIDE_DIR / branch.id / name).exists(), name
    store = StoreManifest(recipe="r")
    for step in (26, 28, 30):
        store.add(record(f"old-{step}", step, branch.at - 100 + step))
    store.branch(branch)
    for cp in listed:
        if cp.step > branch.step:
            store.add(record(cp.name, cp.step, branch.at + cp.step))
    newest = store.newest()
    assert newest is not None
    return {"newest": listed[-1].step, "resumed": branch.step, "aside": sorted(_step(n) for n in branch.aside),
            "store newest": newest.step, "store aside": [r.step for r in store.aside_records()]}


def record(name: str, step: int, written_at: float) -> CheckpointRecord:
    return CheckpointRecord(name=name, step=step, files={name: FileRecord(1, "0" * 64)}, verified_at="x", host="h",
                            written_at=written_at)


def _step(name: str) -> int:
    import re

    return int(re.findall(r"\d+", name.replace("epoch=0-", ""))[-1])


def test_a_checkpointer_restore_of_an_older_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ckpt"
    job = Job(0)
    with job.checkpointer(folder, keep=2) as ckpt:
        for step in range(2, 31, 2):
            job.steps(2)
            ckpt.save(step)
        ckpt.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000028", "step-00000030"]
    resumed = Job(1)
    with resumed.checkpointer(folder, keep=2) as ckpt:
        assert ckpt.restore(folder / "step-00000028") == 28
        assert "step-00000030 set aside in" in capsys.readouterr().err
        resumed.steps(1)
        assert ckpt.finish(29) == str(folder / "step-00000029")
    assert sorted(p.name for p in folder.iterdir()) == [train.ASIDE_DIR, "step-00000028", "step-00000029"]
    assert answer(folder, "dcp") == ANSWER


def test_a_trainer_resume_from_checkpoint_of_an_older_save(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    run_child(TRAINER, tmp_path, folder, 30, 2, "")
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-28", "checkpoint-30"]
    said = run_child(TRAINER, tmp_path, folder, 29, 2, folder / "checkpoint-28")
    assert "checkpoint-30 set aside in" in said
    assert sorted(p.name for p in folder.iterdir()) == [train.ASIDE_DIR, "checkpoint-28", "checkpoint-29"]
    assert answer(folder, "hf-trainer") == ANSWER


def test_a_lightning_fit_from_an_older_ckpt_path(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    run_child(LIGHTNING, tmp_path, folder, 30, 2, "")
    said = run_child(LIGHTNING, tmp_path, folder, 29, 1, folder / "epoch=0-step=28.ckpt")
    assert "epoch=0-step=30.ckpt set aside in" in said
    assert answer(folder, "lightning") == ANSWER
