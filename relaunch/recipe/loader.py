"""Recipe YAML -> `Recipe`: line numbers per key, duplicate keys, `extends`, `--set`, located errors.

Every problem is a RecipeError whose message starts with `file:line: key.path:`. To get
there, each file is parsed into plain data plus {key path: line}, and the merged recipe
keeps {key path: (file, line)} for every key, so a pydantic error far from the YAML (or a
template error much later) still points at the line that wrote the value.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from relaunch.errors import RecipeError
from relaunch.recipe.guesses import marked_lines
from relaunch.recipe.model import REMOTE_PREFIXES, Origin, Recipe, _scalar_text, recipe_keys_of
from relaunch.recipe.providers import did_you_mean
from relaunch.resources import recipes_dir

KeyPath = tuple[str, ...]
Origins = dict[KeyPath, Origin]
SET = "--set"  # the "file" of values that came from the command line


class _RawInt(int):
    raw: str


class _RawFloat(float):
    raw: str


class _LineLoader(yaml.SafeLoader):
    """A SafeLoader that builds plain data from the node tree itself, so that it can record the
    start line of every key and refuse duplicate keys (PyYAML silently keeps the last one).

    Numbers keep the text they were written as (`.raw`), for `3.10` vs `3.1` messages and vars.
    """

    def __init__(self, text: str, display: str) -> None:
        super().__init__(text)
        self.display = display
        self.lines: dict[KeyPath, int] = {}

    def data(self) -> Any:
        node = self.get_single_node()
        return None if node is None else self._build(node, ())

    def _key(self, node: yaml.Node, path: KeyPath) -> str:
        if not isinstance(node, yaml.ScalarNode):
            raise RecipeError("a key must be plain text", file=self.display,
                              line=node.start_mark.line + 1, key=".".join(path) or None)
        key = self.construct_object(node)
        # `3.10:` or `yes:` as keys mean the text, not a number or a boolean.
        return key if isinstance(key, str) else str(node.value)

    def _build(self, node: yaml.Node, path: KeyPath) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for knode, _ in node.value:
                if knode.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` keys may be overridden by the mapping's own keys
                key, line = self._key(knode, path), knode.start_mark.line + 1
                if key in seen:
                    raise RecipeError(
                        f"duplicate key (first at line {seen[key]}, again at line {line})",
                        file=self.display, line=line, key=".".join((*path, key)),
                    )
                seen[key] = line
            self.flatten_mapping(node)
            out: dict[str, Any] = {}
            for knode, vnode in node.value:
                key = self._key(knode, path)
                self.lines[(*path, key)] = knode.start_mark.line + 1
                out[key] = self._build(vnode, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            items = []
            for n, item in enumerate(node.value):
                self.lines[(*path, str(n))] = item.start_mark.line + 1
                items.append(self._build(item, (*path, str(n))))
            return items
        value = self.construct_object(node, deep=True)
        raw_type = {int: _RawInt, float: _RawFloat}.get(type(value))
        if raw_type is not None:
            value = raw_type(value)
            value.raw = node.value
        return value


def _key_near(text: str, line: int) -> str | None:
    """The dotted key a broken YAML line most likely belongs to, from indentation alone."""
    stack: list[tuple[int, str]] = []
    for raw in text.splitlines()[:line]:
        m = re.match(r"([ \t]*)([A-Za-z0-9_.~/-]+)[ \t]*:(\s|$)", raw)
        if m:
            while stack and stack[-1][0] >= len(m[1]):
                stack.pop()
            stack.append((len(m[1]), m[2]))
    return ".".join(k for _, k in stack) or None


def _parse(text: str, display: str) -> tuple[Any, dict[KeyPath, int]]:
    loader = _LineLoader(text, display)
    try:
        return loader.data(), loader.lines
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        # An unclosed quote or bracket is found at the end of the file: point at where it opened.
        if exc.context_mark is not None and "end of stream" in str(exc.problem):
            mark = exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = f"{exc.context}: {exc.problem}" if exc.context else str(exc.problem)
        hint = "YAML indents with spaces only: replace the tab" if "'\\t'" in what else None
        raise RecipeError(f"YAML syntax error: {what}", file=display, line=line,
                          key=_key_near(text, line) if line else None, hint=hint) from None
    except yaml.YAMLError as exc:  # e.g. a control character: no mark to point at
        raise RecipeError(f"YAML error: {exc}", file=display) from None
    finally:
        loader.dispose()


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _why(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def _resolve_local_paths(data: dict[str, Any], lines: dict[KeyPath, int], base: Path,
                         display: str) -> None:
    """Make the local paths one file wrote absolute, relative to that file's folder (in place).

    Runs per file before merging, so a path in `team/base.yaml` means `team/...` even when a
    recipe elsewhere extends it. Values of the wrong type are left for validation to report.
    """
    def local(value: str) -> str:
        p = Path(value).expanduser()
        return os.path.normpath(p if p.is_absolute() else base / p)

    def section(name: str) -> dict[str, Any]:
        value = data.get(name)
        return value if isinstance(value, dict) else {}

    env, ssh, ckpt = section("env"), section("ssh"), section("checkpoint")
    if isinstance(env.get("lock"), str):
        env["lock"] = local(env["lock"])
    if isinstance(ssh.get("key"), str):
        ssh["key"] = local(ssh["key"])
    if isinstance(data.get("templates"), str):
        data["templates"] = local(data["templates"])
    remote = ckpt.get("remote")
    if isinstance(remote, str) and remote and not remote.startswith(REMOTE_PREFIXES):
        ckpt["remote"] = local(remote)
    if isinstance(env.get("files"), dict):
        files: dict[str, Any] = {}
        for written, target in env["files"].items():
            absolute = local(written)
            prefix = ("env", "files", written)
            if absolute in files:
                raise RecipeError(f"the same local file as another entry ({absolute})", file=display,
                                  line=lines.get(prefix), key=f"env.files.{written}")
            files[absolute] = target
            for path in [p for p in lines if p[:3] == prefix]:
                lines[("env", "files", absolute, *path[3:])] = lines.pop(path)
        env["files"] = files


def _merge(base: dict[str, Any], base_origins: Origins, over: dict[str, Any],
           over_origins: Origins) -> tuple[dict[str, Any], Origins]:
    """Deep-merge mappings, `over` wins; a list or scalar replaces whatever was there."""
    replaced: list[KeyPath] = []

    def merge(b: dict[str, Any], o: dict[str, Any], path: KeyPath) -> dict[str, Any]:
        out = dict(b)
        for k, v in o.items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = merge(out[k], v, (*path, k))
            else:
                if k in out:
                    replaced.append((*path, k))
                out[k] = v
        return out

    data = merge(base, over, ())
    origins = {p: o for p, o in base_origins.items() if not any(p[: len(r)] == r for r in replaced)}
    origins.update(over_origins)
    return data, origins


RECIPES_ENV = "RELAUNCH_RECIPES"  # os.pathsep-separated folders of a team's recipe library
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


def is_recipe_name(written: str) -> bool:
    """`base/pytorch` is a name from a recipe library; `team/base.yaml`, `./x`, `/x`, `~/x` are paths."""
    return not written.endswith((".yaml", ".yml")) and not written.startswith(("/", ".", "~"))


def library_folders(start: Path) -> list[tuple[Path, str]]:
    """Where a name is looked up, in order, each with how to call it in a message."""
    places = [(folder, str(folder)) for folder in [start, *start.parents]]
    for entry in os.environ.get(RECIPES_ENV, "").split(os.pathsep):
        if entry:
            places.append((Path(entry).expanduser().absolute(), f"{entry} (${RECIPES_ENV})"))
    places.append((recipes_dir(), f"{recipes_dir()} (shipped with relaunch)"))
    return places


def _find_named(written: str, including: Path, display: str, line: int | None, names: str) -> tuple[Path, str]:
    """The file `NAME.yaml` of the first library folder that has it, and how to display it."""
    if not _NAME_RE.fullmatch(written) or ".." in written.split("/"):
        raise RecipeError(f"{written!r} is neither a recipe name (letters, digits, _ . - and /) nor a "
                          "path ending in .yaml", file=display, line=line, key="extends")
    wanted = f"{written}.yaml"
    folder = Path(os.path.abspath(including)).parent
    places = library_folders(folder)
    tree = len(folder.parents) + 1  # the first places: the folder and those above it
    for n, (place, _) in enumerate(places):
        candidate = place / wanted
        if candidate.is_file():
            # Found in the including file's tree: shown relative to it, as a path would be.
            shown = os.path.normpath(os.path.join(os.path.dirname(display), os.path.relpath(candidate, folder))) \
                if n < tree else str(candidate)
            return candidate, shown
    looked = [f"{folder} and each folder above it"] + [label for _, label in places[tree:]]
    raise RecipeError(
        f"no recipe named {written}: looked for {wanted} in " + ", ".join(looked) + f" (extended by {names})",
        file=display, line=line, key="extends",
        hint=f"a path ending in .yaml is read relative to this file; names come from its folder tree, "
             f"${RECIPES_ENV} and the shipped recipes",
    )


def _load_tree(path: Path, display: str, chain: tuple[tuple[Path, str], ...],
               files: list[str], guessed: dict[Origin, str]) -> tuple[dict[str, Any], Origins]:
    """One file merged over everything it extends (depth first, in order), with origins.

    `files` collects every file read, in the order they are applied (this one last); `guessed`
    the keys each marks as a guess, by their origin: {(file, line): what its GUESS comment says}.
    """
    try:
        text = _read(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read recipe: {_why(exc)}", file=display) from None
    data, lines = _parse(text, display)
    guessed.update({(display, line): note for line, note in marked_lines(text, set(lines.values())).items()})
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError("a recipe is a mapping of keys (name:, env:, checkpoint:, run:)",
                          file=display, line=1)
    _resolve_local_paths(data, lines, Path(os.path.abspath(path)).parent, display)
    chain = (*chain, (Path(os.path.realpath(path)), display))

    extends = data.get("extends", [])
    extends = [extends] if isinstance(extends, str) else extends
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        raise RecipeError("must be a path, a recipe name, or a list of them", file=display,
                          line=lines.get(("extends",)), key="extends")
    merged: dict[str, Any] = {}
    origins: Origins = {}
    for n, written in enumerate(extends):
        line = lines.get(("extends", str(n)), lines.get(("extends",)))
        names = " -> ".join(d for _, d in chain)
        if is_recipe_name(written):
            target, target_display = _find_named(written, path, display, line, names)
        else:
            target = Path(written).expanduser()
            target = target if target.is_absolute() else path.parent / target
            target_display = os.path.normpath(os.path.join(os.path.dirname(display), written))
        real = Path(os.path.realpath(target))
        if any(real == seen for seen, _ in chain):
            raise RecipeError(f"cycle: {names} -> {target_display}", file=display, line=line, key="extends")
        if not target.is_file():
            why = "no such file" if not target.exists() else "not a file"
            raise RecipeError(f"cannot read {target_display}: {why} (extended by {names})",
                              file=display, line=line, key="extends")
        sub, sub_origins = _load_tree(target, target_display, chain, files, guessed)
        merged, origins = _merge(merged, origins, sub, sub_origins)
    files.append(display)
    own: Origins = {p: (display, ln) for p, ln in lines.items()}
    return _merge(merged, origins, data, own)


# --- the schema, for --set and for did-you-mean ---------------------------------------------

def _unwrap(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(sub-model, is a mapping) behind a field's annotation, looking through `X | None`."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, False
        if typing.get_origin(arg) is dict:
            return None, True
    return None, False


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Recipe
    for part in path:
        if model is None or part not in recipe_keys_of(model):
            return None
        model = _unwrap(model.model_fields[recipe_keys_of(model)[part]].annotation)[0]
    return model


def recipe_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included (`ssh`, `ssh.user`, ...)."""
    keys = []
    for key, name in recipe_keys_of(model).items():
        keys.append(prefix + key)
        sub = _unwrap(model.model_fields[name].annotation)[0]
        if sub is not None:
            keys += recipe_keys(sub, f"{prefix}{key}.")
    return keys


def _override_path(key: str) -> KeyPath:
    """The key path `--set KEY=...` names, checked against the schema; a mapping key may hold dots."""
    parts, out = key.split("."), []
    model: type[BaseModel] = Recipe
    while parts:
        part = parts.pop(0)
        if part not in recipe_keys_of(model):
            raise RecipeError(f"unknown key{did_you_mean(key, recipe_keys())}", file=SET, key=key)
        out.append(part)
        sub, is_mapping = _unwrap(model.model_fields[recipe_keys_of(model)[part]].annotation)
        if sub is not None and parts:
            model = sub
        elif is_mapping and parts:
            return (*out, ".".join(parts))
        elif parts:
            raise RecipeError(f"{'.'.join(out)} has no keys inside it", file=SET, key=key)
    return tuple(out)


def _override_value(text: str) -> Any:
    """VALUE as YAML (`3`, `[a, b]`, `{K: v}`, `null`), but unquoted text stays exactly as typed,
    so `--set run.command=python train.py # x` or `echo: hi` is not reinterpreted."""
    quoted = text.strip()[:1] in ("'", '"')
    try:
        value, _ = _parse(text, SET)
    except RecipeError:
        if quoted or text.strip()[:1] in ("[", "{"):
            raise
        return text
    if isinstance(value, str) or (isinstance(value, (dict, list)) and text.strip()[:1] not in ("[", "{")):
        return value if quoted else text
    return value


def _apply_override(data: dict[str, Any], origins: Origins, spec: str) -> tuple[dict[str, Any], Origins]:
    text = spec.strip().removeprefix(SET).strip()
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"expected {SET} KEY.PATH=VALUE, got {spec!r}", file=SET)
    path = _override_path(key.strip())
    over: Any = _override_value(raw)
    for part in reversed(path):
        over = {part: over}
    lines = {path[: n + 1]: 0 for n in range(len(path))}
    _resolve_local_paths(over, lines, Path.cwd(), SET)  # a path typed on the command line: from cwd
    top_path = max(lines, key=len)
    return _merge(data, origins, over, {top_path: (SET, None)})


def _drop_nulls(value: Any) -> Any:
    """`key:` with nothing after it (or `--set key=null`) means "use the default"."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return value


# --- pydantic errors -> located RecipeErrors --------------------------------------------------

def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = _scalar_text(value) if isinstance(value, (int, float)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_MESSAGES = {
    "model_type": "must be a mapping of keys", "model_attributes_type": "must be a mapping of keys",
    "dict_type": "must be a mapping", "list_type": "must be a list", "string_type": "must be a string",
    "int_type": "must be a whole number", "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number", "float_type": "must be a number",
    "float_parsing": "must be a number", "bool_type": "must be true or false",
    "bool_parsing": "must be true or false", "path_type": "must be a path",
}


_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _problem(err: Any, loc: KeyPath) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "missing":
        return "required key missing"
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        return "unknown key" + (did_you_mean(loc[-1], recipe_keys_of(model)) if model else "")
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "literal_error":
        message = f"must be {ctx['expected']}"
    elif kind in _BOUNDS:
        message = f"must be {_BOUNDS[kind]} {next(iter(ctx.values()))}"
    else:
        message = _MESSAGES.get(kind, err["msg"])
    return f"{message}, got {_shown(err['input'])}"


def _locate(origins: Origins, loc: KeyPath) -> Origin:
    for n in range(len(loc), -1, -1):
        if loc[:n] in origins:
            return origins[loc[:n]]
    return origins[()]


def _validation_error(exc: ValidationError, origins: Origins) -> RecipeError:
    found = []
    # An unknown key first: a misspelt section also makes the real one "missing".
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    for err in errors:
        loc = tuple(str(p) for p in err["loc"] if p != "[key]")
        file, line = _locate(origins, loc)
        found.append((file, line, ".".join(loc) or None, _problem(err, loc)))
    file, line, key, message = found[0]
    for f, ln, k, m in found[1:]:  # the first problem is the error; the others come along
        message += f"\n  also {f}:{ln}: {k}: {m}" if ln else f"\n  also {f}: {k}: {m}"
    return RecipeError(message, file=file, line=line, key=key)


def _cross_checks(recipe: Recipe) -> None:
    """Rules that span keys, located at the key to change."""
    if recipe.checkpoint.via == "instance" and isinstance(recipe.checkpoint.remote, Path):
        file, line = recipe.locate("checkpoint.via")
        raise RecipeError(
            "instance: the instance cannot reach a path on this machine; use an rclone: or hf: "
            "remote, or via: local", file=file, line=line, key="checkpoint.via",
        )


# Keys that name one thing for every host and node (the store, which files are checkpoints):
# rendered once, here, with the recipe's name and the env.vars that are the same on every host,
# so that every use and every message has the value itself; the other strings are rendered per
# host (render.py).
ONE_FOR_EVERY_HOST = (("checkpoint", "remote"), ("checkpoint", "pattern"))


def _same_on_every_host(data: dict[str, Any]) -> dict[str, Any]:
    """`name`, and each of env.vars whose value uses no other variable than `name` (rendered with
    the built-in variables only, as render.py does): `remote: s3:b/{{ PROJECT }}/{{ name }}`."""
    import jinja2

    ctx: dict[str, Any] = {"name": data.get("name")}
    env = data.get("env")
    variables = env.get("vars") if isinstance(env, dict) else None
    if not isinstance(variables, dict):
        return ctx
    jinja = jinja2.Environment(undefined=jinja2.StrictUndefined)
    builtins = dict(ctx)
    for var, value in variables.items():
        if isinstance(value, (bool, int, float)):
            ctx[var] = _scalar_text(value)
        elif isinstance(value, str):
            try:
                ctx[var] = jinja.from_string(value).render(**builtins)
            except jinja2.TemplateError:
                pass            # it differs from host to host (or is wrong: its own key says so later)
    return ctx


def _render_one_for_every_host(data: dict[str, Any], origins: Origins) -> None:
    import jinja2

    section = data.get("checkpoint")
    if not isinstance(section, dict):
        return
    ctx: dict[str, Any] | None = None
    for path in ONE_FOR_EVERY_HOST:
        value = section.get(path[1])
        if not isinstance(value, str) or "{" not in value:
            continue
        ctx = _same_on_every_host(data) if ctx is None else ctx
        try:
            section[path[1]] = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(value).render(**ctx)
        except jinja2.TemplateError as exc:
            file, line = _locate(origins, path)
            raise RecipeError(f"{exc.message}: it is the same for every host, so it may use {{{{ name }}}} and "
                              "env.vars that use nothing else", file=file, line=line, key=".".join(path)) from None


def overrides_data(overrides: Sequence[str]) -> dict[str, Any]:
    """What `--set KEY.PATH=VALUE` options say, as nested data (local paths made absolute from
    the current directory): for a command that writes a recipe rather than reads one (`adopt`)."""
    data: dict[str, Any] = {}
    origins: Origins = {(): (SET, None)}
    for spec in overrides:
        data, origins = _apply_override(data, origins, spec)
    return data


def load_data(data: dict[str, Any], overrides: Sequence[str] = (), display: str = "recipe") -> Recipe:
    """A recipe from data instead of a file (`display` names it in errors), `--set` applied."""
    origins: Origins = {(): (display, None)}
    for spec in overrides:
        data, origins = _apply_override(data, origins, spec)
    _render_one_for_every_host(data, origins)
    try:
        recipe = Recipe.model_validate(_drop_nulls(data))
    except ValidationError as exc:
        raise _validation_error(exc, origins) from None
    recipe._origins = origins
    _cross_checks(recipe)
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, merge (`extends`), override (`--set KEY.PATH=VALUE`) and validate a recipe.

    Relative local paths (env.lock, env.files keys, ssh.key, a local checkpoint.remote) are
    made absolute against the folder of the file that wrote them; `--set` paths against the
    current directory. Any problem is a RecipeError starting with `file:line: key.path:`.
    """
    display = str(path)
    top = Path(path).expanduser()
    files: list[str] = []
    guessed: dict[Origin, str] = {}
    data, origins = _load_tree(top, display, chain=(), files=files, guessed=guessed)
    if not data:
        raise RecipeError("the recipe is empty", file=display)
    origins[()] = (display, None)
    for spec in overrides:
        data, origins = _apply_override(data, origins, spec)
    _render_one_for_every_host(data, origins)
    try:
        recipe = Recipe.model_validate(_drop_nulls(data))
    except ValidationError as exc:
        raise _validation_error(exc, origins) from None
    recipe._source = Path(os.path.abspath(top))
    recipe._origins = origins
    recipe._files = files
    # a guess stands while the value is the one its file wrote (another file or --set wins over it)
    recipe._guesses = {p: guessed[o] for p, o in origins.items() if o in guessed}
    _cross_checks(recipe)
    return recipe
