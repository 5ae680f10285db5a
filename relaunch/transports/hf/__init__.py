"""A store in a Hugging Face Hub repo: `checkpoint.remote: hf:OWNER/REPO[/SUBFOLDER]`.

Layout in the repo (all under SUBFOLDER when given): each checkpoint under its own name, as
the trainer wrote it, and `.relaunch/` with the manifest and the meta files, exactly like a
local store. Reading, writing the manifest and verifying run here with huggingface_hub's HfApi.

Credentials: this machine's HF_TOKEN (else the token `hf auth login` stored), as the `hf` CLI
does; it is not a training secret, so it needs no place in env.secrets (instance.py says how it
reaches the instance's `hf`).

HfStore (store.py) is these rooms composed: HfRepo (repo.py) holds the state, the others are mixins
over it:

- repo.py       the repo read at one commit from this machine: its tree, the manifest, a Trainer's
                `last-checkpoint/`; every Hub call's failure as one line of ours
- commits.py    several writers: the manifest committed against the head, merged and tried again
- meta.py       the meta files beside the manifest: held until it is committed, compare-and-set
- pruning.py    pruning against the head, and the instance uploads nothing will move into place
- verifying.py  the repo's files at one commit against the expected sizes and hashes
- instance.py   via: instance (the default): the instance runs `hf upload` / `hf download`
- local.py      via: local: the relay's uploads to the repo and downloads from it, on this machine

and what they call: client.py, the Hub client (bounded calls, snapshots, ids); merge.py, the
writers' merge of two manifests.
"""

from .store import HfStore

__all__ = ["HfStore"]
