"""The recipe: YAML -> a validated, typed `Recipe` whose errors point at file:line and key.

    recipe = load_recipe("llama.yaml", overrides=["checkpoint.keep=3"])
    ctx = render_context(recipe, host="1.2.3.4", checkpoint="~/ckpt/ckpt-00000500.pt", step=500)
    text, env = render_shell_at(recipe, "run.command", ctx)   # export env (shlex.quote), then run text
"""

from relaunch.recipe.loader import load_recipe
from relaunch.recipe.model import SSH, Checkpoint, Env, Recipe, Run, Stop
from relaunch.recipe.providers import Provider, load_providers, starter_recipe
from relaunch.recipe.render import check_recipe, render_at, render_context, render_shell_at

from . import variables

__all__ = [
    "SSH", "Checkpoint", "Env", "Provider", "Recipe", "Run", "Stop",
    "check_recipe", "load_providers", "load_recipe", "render_at", "render_context", "render_shell_at",
    "starter_recipe", "variables",
]
