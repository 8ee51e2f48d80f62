"""What the `pdserve` subcommands share: their parser class and help format, the one-line
error they raise, and the engine's flags with the engine arguments they make (one home:
`generate` and `serve` take the same flags)."""

from __future__ import annotations

import argparse


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default once (options without help get one too; a
    help that names its default, or an option without one, gets none added); descriptions
    keep their line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """A refused command line: one line naming the problem and where the options are
        (argparse's own prints the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def engine_flags(only: tuple[str, ...] | None = None) -> list[tuple[str, object, object]]:
    """(keyword, default, Flag) of the engine's settings that a flag sets (pdserve.engine.settings),
    in their groups' order; `only`: these keywords."""
    from pdserve.engine.settings import GROUPS, flagged

    rows = [row for group in GROUPS for row in flagged(group)]
    return rows if only is None else [r for r in rows if r[0] in only]


def add_engine_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                    defaults: dict | None = None) -> None:
    """The engine's flags, made from its settings' fields (one field, one flag): each flag's
    name, help, type, choices and default are the field's. `only`: these keywords' flags;
    `defaults`: other defaults where a command plans for another machine (`pdserve plan`)."""
    kinds = {"int": int, "float": float, "json": json_object}
    for key, default, flag in engine_flags(only):
        default = (defaults or {}).get(key, None if flag.given_only else default)
        names = [flag.option(key), *([flag.short] if flag.short else [])]
        kw = {"dest": key, "default": default, "help": flag.help}
        if flag.kind == "switch":
            kw["action"] = "store_true"
        elif flag.kind == "toggle":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kinds.get(flag.kind)
            if flag.choices:
                kw["choices"] = flag.choices
            if flag.name:  # its value named as the flag reads
                kw["metavar"] = flag.name.lstrip("-").replace("-", "_").upper()
        p.add_argument(*names, **kw)


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def check_kv_dirs(args: argparse.Namespace) -> None:
    """The KV tiers' directories, before any worker starts: each one given can be made and
    written here (this host's workers use it), and --kv-disk-size comes with --kv-disk-dir."""
    import os
    import tempfile

    if args.kv_disk_size and args.kv_disk_dir is None:
        raise CliError(f"--kv-disk-size {args.kv_disk_size:g} needs --kv-disk-dir DIR (where the block files go)")
    if args.kv_disk_dir is not None and not args.kv_disk_size:
        raise CliError(f"--kv-disk-dir {args.kv_disk_dir} needs --kv-disk-size GiB (how much of it the tier may fill)")
    for flag, path in (("--kv-disk-dir", args.kv_disk_dir), ("--kv-persist-dir", args.kv_persist_dir)):
        if path is None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            raise CliError(f"{flag} {path}: cannot create or write it ({e.strerror or e})") from None


def in_flags(message: str) -> str:
    """An engine refusal in the words the user typed: each engine keyword (snake_case) that a
    flag of `generate` / `serve` sets is named as that flag (kv_offloading_size ->
    --kv-offloading-size)."""
    import re

    flags = {key: flag.option(key) for key, _, flag in engine_flags() if "_" in key}  # keywords, never prose
    keys = sorted(flags, key=len, reverse=True)
    return re.sub(r"(?<![\w-])(" + "|".join(map(re.escape, keys)) + r")(?![\w-])", lambda m: flags[m.group(1)], message)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine keywords the flags set (`model` included); a `given_only` flag's only where it
    was given."""
    out = {}
    for key, _, flag in engine_flags():
        value = getattr(args, key)
        if not (flag.given_only and value is None):
            out[key] = value
    return out
