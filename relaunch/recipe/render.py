"""Jinja2 rendering of recipe strings, and `relaunch check`'s dry render of all of them.

Every recipe string may use the contract's variables (`name`, `host`, `checkpoint`, ...) and
`env.vars`. An undefined variable or a template syntax error is a RecipeError located at the
file:line and key of the string, never a Jinja traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from pydantic import BaseModel

from relaunch.errors import RecipeError
from relaunch.recipe.model import Recipe
from relaunch.recipe.providers import did_you_mean

# keep_trailing_newline: a block scalar's last newline is part of a setup script.
_ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
_HOOK = "__relaunch_shell_value"
_MARK = "\x00"  # YAML cannot carry NUL, so no recipe string contains our markers


def render_context(
    recipe: Recipe,
    *,
    host: str = "",
    user: str = "",
    home: str = "",
    checkpoint: str = "",
    step: int = 0,
    gpus: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "",
    world_size: int | None = None,
    nproc_per_node: int | None = None,
    grad_accum: int = 1,
) -> dict[str, Any]:
    """The contract's template variables plus `env.vars`.

    `user` defaults to `ssh.user`; `nproc_per_node` to run.nproc_per_node, else max(gpus, 1);
    `world_size` to nproc_per_node * nnodes. The values of `env.vars` are themselves rendered
    with the built-in variables (not with each other), so `OUT: ~/out/{{ name }}` works.
    """
    nproc = nproc_per_node or recipe.run.nproc_per_node or max(gpus, 1)
    ctx: dict[str, Any] = {
        "name": recipe.name,
        "host": host,
        "user": user or recipe.ssh.user,
        "home": home,
        "checkpoint": checkpoint,
        "step": step,
        "gpus": gpus,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "master_addr": master_addr,
        "world_size": nproc * nnodes if world_size is None else world_size,
        "nproc_per_node": nproc,
        "grad_accum": grad_accum,
    }
    builtins = dict(ctx)
    for var, text in recipe.env.vars.items():
        ctx[var] = render_text(recipe, text, builtins, f"env.vars.{var}")
    # where checkpoints go, rendered as its key is everywhere (with env.vars), `~` expanded when the
    # home is known: a command written once for every provider's disks (`--out "{{ checkpoint_dir }}"`)
    folder = render_text(recipe, recipe.checkpoint.dir, ctx, "checkpoint.dir")
    if home and (folder == "~" or folder.startswith("~/")):
        folder = home.rstrip("/") + folder[1:]
    ctx["checkpoint_dir"] = folder.rstrip("/") or "/"
    return ctx


def _error(recipe: Recipe, key: str, message: str, hint: str | None = None) -> RecipeError:
    file, line = recipe.locate(key)
    return RecipeError(message, file=file, line=line, key=key, hint=hint)


def _translate(recipe: Recipe, key: str, context: dict[str, Any], exc: Exception) -> RecipeError:
    """A Jinja (or Python) failure while rendering, as a located RecipeError."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return _error(recipe, key, f"template syntax error: {exc.message}")
    if isinstance(exc, jinja2.UndefinedError):
        m = re.fullmatch(r"'(\w+)' is undefined", str(exc.message))
        if m:
            names = sorted(k for k in context if not k.startswith("__"))
            return _error(
                recipe, key,
                f"undefined variable {m[1]!r}{did_you_mean(m[1], names)}",
                hint="variables: " + ", ".join(names),
            )
        return _error(recipe, key, f"template error: {exc.message}")
    return _error(recipe, key, f"template failed: {type(exc).__name__}: {exc}")


def render_text(recipe: Recipe, text: str, context: dict[str, Any], key: str) -> str:
    """Render one recipe string; errors are located at `key`."""
    try:
        return _ENV.from_string(text).render(context)
    except Exception as exc:  # any failure inside a user's template is the recipe's problem
        raise _translate(recipe, key, context, exc) from exc


def render_at(recipe: Recipe, key: str, context: dict[str, Any]) -> str:
    """The string at dotted `key`, rendered with Jinja2 (undefined variables are errors)."""
    return render_text(recipe, recipe.value(key), context, key)


def render_shell_at(recipe: Recipe, key: str, context: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The string at `key` for a shell, variables as `${RELAUNCH_<NAME>}`: see render_shell."""
    return render_shell(recipe, recipe.value(key), context, key)


def render_shell(recipe: Recipe, text: str, context: dict[str, Any], key: str) -> tuple[str, dict[str, str]]:
    """Render a string that a shell will run (run.command, an env.setup line), injection-free.

    Every `{{ expression }}` renders as a reference to an environment variable instead of its
    value: `{{ checkpoint }}` becomes `"${RELAUNCH_checkpoint}"` and the returned dict holds
    {"RELAUNCH_checkpoint": value}. The caller exports that dict (each value through
    `shlex.quote`) before the text. So a checkpoint path or a var holding `$(...)`, `;`,
    quotes or spaces stays one piece of data, whether the user wrote `"{{ checkpoint }}"` or
    `{{ checkpoint }}`:

    - outside quotes (also inside `$(...)`) the reference is wrapped in double quotes,
      so it is one word: no splitting, no globbing;
    - inside double quotes it is left bare (already one word);
    - inside single quotes it is left bare as well: that text is for another interpreter
      (`bash -c '... {{ x }}'`), which finds the variable in the environment it inherits.
      A non-shell reader (`python -c '...'`) would see the literal `${RELAUNCH_x}`: use
      double quotes there.

    An expression that is a plain name uses that name (`RELAUNCH_step`); anything else
    (`{{ step + 1 }}`) is `RELAUNCH_expr`, with `_2`, `_3`... when names repeat with other
    values. To split a value into several words on purpose, put it in `env.vars` and write
    `$NAME` in the shell: vars are exported as themselves too. A quoted reference is not
    tilde-expanded, so pass instance paths in the context already expanded (`/root/ckpt/x`,
    not `~/ckpt/x`). Known limit: a reference inside a heredoc body gets the double quotes
    of the unquoted case.
    """
    try:
        tree = _ENV.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise _translate(recipe, key, context, exc) from exc
    # Wrap each {{ expression }} in a call to our hook, which stores the value and outputs a marker.
    def wrap(expr: nodes.Expr) -> nodes.Expr:
        if isinstance(expr, nodes.TemplateData):
            return expr
        hint = expr.name if isinstance(expr, nodes.Name) else "expr"
        call = nodes.Call(nodes.Name(_HOOK, "load"), [nodes.Const(hint), expr], [], None, None)
        call.set_lineno(expr.lineno).set_environment(_ENV)
        return call

    for output in tree.find_all(nodes.Output):
        output.nodes = [wrap(n) for n in output.nodes]
    values: dict[str, str] = {}
    refs: list[str] = []

    def hook(hint: str, value: Any) -> str:
        data = str(value)  # StrictUndefined raises here, as in plain rendering
        name, n = f"RELAUNCH_{hint}", 1
        while values.get(name, data) != data:
            n += 1
            name = f"RELAUNCH_{hint}_{n}"
        values[name] = data
        refs.append(name)
        return f"{_MARK}{len(refs) - 1}{_MARK}"

    try:
        template = _ENV.template_class.from_code(_ENV, _ENV.compile(tree), _ENV.make_globals(None), None)
        rendered = template.render({**context, _HOOK: hook})
    except Exception as exc:  # as in render_text: the user's template failed
        raise _translate(recipe, key, context, exc) from exc
    return _place_references(rendered, refs), values


def _place_references(text: str, refs: list[str]) -> str:
    """Replace markers by `${NAME}`, double-quoted where the shell would otherwise split it.

    A small scanner of shell quoting: a stack of contexts, each unquoted ("", also the inside
    of `$(...)` with its paren depth), `'` or `"`.
    """
    out: list[str] = []
    stack: list[list[Any]] = [["", 0]]
    i = 0
    while i < len(text):
        kind = stack[-1][0]
        c = text[i]
        if c == _MARK:
            end = text.index(_MARK, i + 1)
            ref = "${" + refs[int(text[i + 1:end])] + "}"
            out.append(ref if kind in ("'", '"') else f'"{ref}"')
            i = end + 1
            continue
        out.append(c)
        i += 1
        if kind == "'":
            if c == "'":
                stack.pop()
        elif c == "\\" and i < len(text) and text[i] != _MARK:
            out.append(text[i])  # the escaped character never changes the quoting
            i += 1
        elif c == "$" and text.startswith("(", i):
            out.append("(")
            i += 1
            stack.append(["$(", 0])
        elif kind == '"':
            if c == '"':
                stack.pop()
        elif c in "'\"":
            stack.append([c, 0])
        elif kind == "$(" and c == "(":
            stack[-1][1] += 1
        elif kind == "$(" and c == ")":
            if stack[-1][1] == 0:
                stack.pop()
            else:
                stack[-1][1] -= 1
    return "".join(out)


def _strings(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """(dotted key, text) of every string in the recipe (Paths are local paths, not templates)."""
    if isinstance(node, str):
        yield key, node
    elif isinstance(node, BaseModel):
        for written, field in ((f.alias or n, n) for n, f in type(node).model_fields.items()):
            yield from _strings(getattr(node, field), f"{key}.{written}" if key else written)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{key}.{k}")
    elif isinstance(node, list):
        for n, v in enumerate(node):
            yield from _strings(v, f"{key}.{n}")


def sample_context(recipe: Recipe) -> dict[str, Any]:
    """A plausible context for rendering without a host (`relaunch check`)."""
    user = recipe.ssh.user
    return render_context(
        recipe, host="203.0.113.10", user=user, home="/root" if user == "root" else f"/home/{user}",
        checkpoint=f"{recipe.checkpoint.dir}/ckpt-00001000.pt", step=1000, gpus=8, nnodes=1,
        node_rank=0, master_addr="203.0.113.10",
    )


def disk_findings(recipe: Recipe) -> tuple[list[str], list[str]]:
    """(warnings, notes) about where checkpoint.dir and env.venv sit on the provider's disks, for
    `relaunch check`: rendered with the sample context, `~` as the home ssh.user would have."""
    from relaunch.recipe.disks import recipe_disk_warnings

    ctx = sample_context(recipe)
    home = ctx["home"]
    paths = {key: render_text(recipe, str(recipe.value(key)), ctx, key) for key in ("checkpoint.dir", "env.venv")}
    return recipe_disk_warnings(recipe, home, paths)


def check_recipe(recipe: Recipe, lock_needed: bool = True) -> list[str]:
    """Render every string with a sample context and check the local files the recipe names.

    Raises RecipeError (file:line, key) on an undefined variable, a template syntax error,
    or a missing local file that `up` would need (the lock too, unless `lock_needed` is False:
    `freeze` writes it, and the commands that install nothing can do without it). Returns notes
    worth a look that are not errors (no lock, a secret not set in this shell, ...).
    """
    ctx = sample_context(recipe)
    shell_keys = {"run.command", "recover.command", "recover.alive"} | {f"env.setup.{n}"
                                                                        for n in range(len(recipe.env.setup))}
    for key, text in _strings(recipe, ""):
        if key.startswith("env.vars."):
            continue  # rendered by render_context already
        if key in shell_keys:
            render_shell(recipe, text, ctx, key)
        else:
            render_text(recipe, text, ctx, key)

    if recipe.templates is not None:
        check_templates(recipe)
    for local in recipe.env.files:
        if not local.exists():
            raise _error(recipe, f"env.files.{local}", f"local file {local} does not exist")
    if recipe.ssh.key is not None and not recipe.ssh.key.is_file():
        raise _error(recipe, "ssh.key", f"key file {recipe.ssh.key} does not exist")

    notes = []
    lock = recipe.env.lock
    if lock is None:
        notes.append("no env.lock: nothing pins the environment; once it works, "
                     "`relaunch freeze RECIPE` writes one and names it here")
    elif not lock.is_file():
        if lock_needed:
            raise _error(recipe, "env.lock", f"the lock file {lock} does not exist",
                         hint="`relaunch freeze RECIPE HOST` writes it from an instance whose env works (one that "
                              "`relaunch up` brought up before env.lock was set); or fix the path, or remove env.lock")
        notes.append(f"env.lock {lock} does not exist yet (`relaunch freeze RECIPE HOST` writes it)")
    for name in recipe.env.secrets:
        if name not in os.environ:
            notes.append(f"secret {name} is not set in this shell: there is nothing to hand to the instance")
    remote = recipe.checkpoint.remote
    if isinstance(remote, Path) and not remote.exists():
        notes.append(f"checkpoint.remote {remote} does not exist yet: the first copy creates it")
    return notes


def check_templates(recipe: Recipe) -> None:
    """A `templates:` folder holds only replacements for shipped scripts, each one that compiles,
    includes what exists and uses only the values its shipped script is given; anything else is an
    error located at `templates`, so a typo in a file name never silently does nothing."""
    from jinja2 import meta

    from relaunch import scripts

    folder = recipe.templates
    assert folder is not None
    if not folder.is_dir():
        raise _error(recipe, "templates", f"{folder} is not a folder" if folder.exists() else
                     f"folder {folder} does not exist")
    shipped = scripts.shipped_names()
    env = scripts.environment(folder)
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue  # .gitkeep and editor files
        if path.name not in shipped or not path.is_file():
            raise _error(recipe, "templates",
                         f"{path} is not one of relaunch's instance scripts{did_you_mean(path.name, shipped)}",
                         hint="a templates folder may hold only: " + ", ".join(shipped))
        if not path.name.endswith(".j2"):
            continue  # plain scripts (facts.sh) are sent as they are
        try:
            tree = env.parse(path.read_text(encoding="utf-8"), path.name, str(path))
            env.get_template(path.name)
        except jinja2.TemplateSyntaxError as exc:
            raise _error(recipe, "templates", f"{path}:{exc.lineno}: template syntax error: {exc.message}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise _error(recipe, "templates", f"cannot read {path}: {exc}") from None
        for included in meta.find_referenced_templates(tree):
            try:
                if included:
                    env.get_template(included)
            except jinja2.TemplateNotFound:
                raise _error(recipe, "templates", f"{path}: includes {included!r}, which is neither in the "
                             f"folder nor a shipped script (shipped/NAME reaches the shipped ones)") from None
        unknown = sorted(meta.find_undeclared_variables(tree) - scripts.given_variables(path.name))
        if unknown:
            raise _error(recipe, "templates", f"{path}: uses {', '.join(unknown)}, which {path.name} is not "
                         "given", hint="it is given: " + ", ".join(sorted(scripts.given_variables(path.name))))
