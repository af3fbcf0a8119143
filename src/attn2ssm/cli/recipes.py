"""``attn2ssm recipes [NAME]``: list the built-in recipes, or print one as YAML."""

from __future__ import annotations

from attn2ssm.errors import CheckpointError


def add_parser(subparsers) -> None:
    r = subparsers.add_parser("recipes", help="list built-in recipes, or print one")
    r.add_argument("name", nargs="?")
    r.set_defaults(func=run)


def run(args) -> int:
    from attn2ssm.distill.recipe import builtin_recipes, load_recipe  # torch (through attn2ssm.precision)

    recipes = builtin_recipes()
    if args.name:
        if args.name not in recipes:
            raise CheckpointError(f"no built-in recipe '{args.name}'", f"choose one of: {', '.join(recipes)}")
        print(load_recipe(args.name).to_yaml())
        return 0
    for name in recipes:
        r = load_recipe(name)
        tokens = sum(s.tokens for s in r.stages)
        stages = " → ".join(f"{s.name}({s.kind})" for s in r.stages)
        print(f"{name:<14} {stages}; {tokens:,} tokens. {r.description}")
    return 0
