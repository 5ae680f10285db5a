"""`relaunch sandbox`: local instances in network namespaces, shaped like the images people rent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .common import cli, emit


@cli.group(short_help="Throwaway local instances for trying recipes")
def sandbox() -> None:
    """Throwaway local instances (Linux, root): own address, real sshd, empty private disk; --image
    reproduces a provider's stock image, and stop/start/pause/resume do what its provider does."""


def _image_names() -> list[str]:
    from ..sandbox.images import PROFILES

    return list(PROFILES)


@sandbox.command("create", short_help="Create instance NAME and print how to reach it")
@click.argument("name")
@click.option("--image", type=click.Choice(_image_names()), default="default", show_default=True,
              help="Reproduce a provider's stock image (see `relaunch sandbox images`); default: this machine as it "
                   "is.")
@click.option("--user", type=click.Choice(["root", "ubuntu"]), default=None,
              help="The login user: root, or ubuntu with passwordless sudo (as on cloud images); default: root on the "
                   "default image, and each other image has its own.")
@click.option("--disk", default="4G", show_default=True, help="Size of the instance's private home (tmpfs).")
@click.option("--volume", default="8G", show_default=True,
              help="Size of the image's other disk (/workspace, /lambda/nfs/NAME, /opt/dlami/nvme; tmpfs).")
@click.option("--rate", default=None, help="Shape the link, e.g. 100mbit (tc tbf).")
@click.option("--key", "key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The one public key to authorize (default: relaunch's sandbox key and your own: your ssh-agent's "
                   "keys and ~/.ssh/id_*.pub, as a provider has the keys you uploaded).")
@click.option("--index", "index", type=click.Path(exists=True, file_okay=False), default=None,
              help="Serve this package index (a folder with simple/, made by `relaunch sandbox index`) inside the "
                   "instance on 127.0.0.1:8765.")
@click.option("--address", default=None,
              help="This free address of the sandbox's range (one a destroyed instance had: providers reuse "
                   "addresses); default: the next free one.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_create(name: str, image: str, user: str | None, disk: str, volume: str, rate: str | None,
                   key: str | None, index: str | None, address: str | None, as_json: bool) -> None:
    """Create instance NAME and print how to reach it."""
    from .. import sandbox as sb

    yours = sb.users_keys() if key is None else []
    inst = sb.create(name, image=image, user=user, authorized_key=Path(key) if key else None,
                     also_authorize=[k.line for k in yours], disk=disk, volume=volume, rate=rate,
                     index_dir=Path(index) if index else None, address=address)
    if as_json:
        emit(True, {**inst.__dict__, "host": inst.host, "key": str(sb.default_key()) if key is None else None,
                    "your_keys": [{"source": k.source, "fingerprint": k.fingerprint} for k in yours]})
        return
    click.echo(f"{inst.name}: {inst.host}  host key {inst.host_key_fingerprint}"
               + (f"  image {inst.image}" if inst.image != "default" else ""))
    if key is None:
        click.echo(f"  ssh key: {sb.default_key()}  (recipe: --set ssh.key={sb.default_key()})")
        if yours:
            click.echo("  your keys, authorized too (no ssh.key needed): "
                       + ", ".join(f"{k.source} {k.fingerprint}" for k in yours))
        else:
            click.echo("  your keys: none found (no ~/.ssh/id_*.pub, no ssh-agent key); make one with "
                       "`ssh-keygen -t ed25519` and create again, or use the ssh key above")
    if inst.index_url:
        click.echo(f"  package index inside the instance: {inst.index_url}")


@sandbox.command("index", short_help="Make a package index for sandbox instances from a lock")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--from", "sources", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A requirements file or lock (a `pip freeze`) whose packages the index holds; repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_index(folder: str, sources: tuple[str, ...], as_json: bool) -> None:
    """Make FOLDER a package index for sandbox instances, which reach no registry: pip downloads here,
    from this machine's configured index, the packages of each --from file and what relaunch itself
    installs on an instance (pip, uv, rclone, hf), and writes a PEP 503 simple/ tree beside them.
    Serve it with `relaunch sandbox create NAME --index FOLDER`. Run again, it downloads only what is new."""
    from .. import sandbox as sb

    dest = sb.build_index([Path(s) for s in sources], Path(folder)).resolve()
    projects = sorted(p.name for p in (dest / "simple").iterdir() if p.is_dir())
    if as_json:
        emit(True, {"index": str(dest), "projects": projects, "index_url": sb.INDEX_URL})
        return
    click.echo(f"{dest}: a package index of {len(projects)} projects")
    click.echo(f"  serve it inside an instance: relaunch sandbox create NAME --index {dest}")
    click.echo(f"  a recipe's instances find it at env.index_url: {sb.INDEX_URL}")


@sandbox.command("destroy", short_help="Destroy instance NAME: processes, disk, address, namespace")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_destroy(name: str, as_json: bool) -> None:
    """Destroy instance NAME: its processes, disk, address and namespace."""
    from .. import sandbox as sb

    destroyed = sb.destroy(name)
    if as_json:
        emit(True, {"name": name, "destroyed": destroyed})
        return
    click.echo(f"{name}: {'destroyed' if destroyed else 'no such instance'}")


@sandbox.command("clean", short_help="Undo everything the sandbox changed on this machine")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_clean(as_json: bool) -> None:
    """Undo everything the sandbox changed on this machine: destroy this sandbox dir's instances,
    remove what instances whose records a reboot (or a killed destroy) lost left behind, and, once no
    instance is left on the machine, the `ubuntu` user's changes, its sudoers file, the routes,
    folders and caches it made. It works from a journal a reboot keeps
    (/var/lib/relaunch-sandbox/changes.json)."""
    from .. import sandbox as sb

    done = sb.clean()
    if as_json:
        emit(True, {"undone": done.undone, "kept": done.kept})
        return
    for line in done.undone or ["nothing to undo"]:
        click.echo(line)
    for line in done.kept:
        click.echo(f"kept: {line}")


@sandbox.command("list", short_help="List the sandbox instances")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_list(as_json: bool) -> None:
    """List the sandbox instances."""
    from .. import sandbox as sb

    instances = sb.list_instances()
    if as_json:
        emit(True, [{**i.__dict__, "host": i.host, "state": sb.state(i.name)} for i in instances])
        return
    for inst in instances:
        click.echo(f"{inst.name:<14} {inst.host:<27} {inst.image:<13} {sb.state(inst.name):<8} "
                   f"{inst.host_key_fingerprint}")


@sandbox.command("images", short_help="The image profiles `create --image` takes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_images(as_json: bool) -> None:
    """The image profiles `create --image` takes, and what each reproduces."""
    from ..sandbox.images import PROFILES

    if as_json:
        emit(True, [{"name": i.name, "kind": i.kind, "user": i.user, "python": i.python,
                     "home_survives_stop": i.home_survives_stop, "can_pause": i.can_pause,
                     "stop_grace": i.stop_grace, "mapped_port": i.mapped_port,
                     "volumes": [{"path": v.path, "survives_stop": v.survives_stop} for v in i.volumes],
                     "summary": i.summary} for i in PROFILES.values()])
        return
    for image in PROFILES.values():
        click.echo(f"{image.name:<13} {image.summary}")


def _now(name: str, state: str, as_json: bool, **more: Any) -> None:
    """What a power command leaves: `NAME: STATE`, or its JSON document."""
    if as_json:
        emit(True, {"name": name, "state": state, **more})
    else:
        click.echo(f"{name}: {state}")


@sandbox.command("stop", short_help="Stop instance NAME as its provider does")
@click.argument("name")
@click.option("--grace", type=click.FloatRange(min=0), default=None,
              help="Seconds from the stop's SIGTERM to the SIGKILL of everything left (default: the image's: "
                   "runpod 5, vast 10, VMs 30, default 0).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_stop(name: str, grace: float | None, as_json: bool) -> None:
    """Stop instance NAME as its provider does: what survives a stop stays, the rest is wiped."""
    from .. import sandbox as sb

    _now(name, "stopped", as_json, grace=sb.stop(name, grace=grace))


@sandbox.command("start", short_help="Start a stopped instance NAME again")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_start(name: str, as_json: bool) -> None:
    """Start a stopped instance NAME again: same address, host key, port and surviving disks."""
    from .. import sandbox as sb

    sb.start(name)
    inst = sb.get(name)
    if as_json:
        emit(True, {**inst.__dict__, "host": inst.host, "state": "running"})
        return
    click.echo(f"{name}: running  {inst.host}")


@sandbox.command("pause", short_help="Freeze every process of NAME, as Vast pauses an instance")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_pause(name: str, as_json: bool) -> None:
    """Freeze every process of instance NAME, as Vast pauses an outbid instance (no signal)."""
    from .. import sandbox as sb

    sb.pause(name)
    _now(name, "paused", as_json)


@sandbox.command("resume", short_help="Thaw a paused instance NAME")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_resume(name: str, as_json: bool) -> None:
    """Thaw a paused instance NAME: every process goes on where it was."""
    from .. import sandbox as sb

    sb.resume(name)
    _now(name, "running", as_json)
