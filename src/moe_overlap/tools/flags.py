"""Flags generated from settings dataclasses (``engine/args.py``, ``server/settings.py``): one
flag per field, named after it, with its aliases, type, choices and help, and the default
read from the field. ``--config FILE`` expands a YAML file of flags, as SGLang and vLLM do."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.args import setting
from moe_overlap.tools.trace import PLOT_FORMATS, plot_format

T = TypeVar("T")
HF_CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "architectures")


def output_path(text: str) -> str:
    """A file a command writes (``--json``, ``--trace``, ``--plot``), refused as it is parsed,
    not after the run: a directory, or a path under a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path in it")
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {parent} is a file")
    return text


def plot_path(text: str) -> str:
    """``--plot``: an output file whose suffix names an image format (none: a PNG)."""
    if plot_format(output_path(text)) is None:
        formats = ", ".join(f".{f}" for f in PLOT_FORMATS)
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot draw a {Path(text).suffix!r} file; end it in one of {formats}"
        )
    return text


def server_url(text: str) -> str:
    """``--base-url``: an http(s) URL with a host (and a valid port, if any)."""
    try:
        url = urlsplit(text)
        ok = url.scheme in ("http", "https") and url.hostname and (url.port or 0) >= 0
    except ValueError:  # a port out of range, an unclosed IPv6 bracket
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want http(s)://HOST[:PORT], e.g. http://127.0.0.1:8000"
        )
    return text


def output_setting(help: str, **meta: Any) -> Any:
    """A command's output file: no default, checked by ``output_path``."""
    return setting(None, help, metavar="PATH", parse=output_path, **meta)


def plot_setting(help: str, **meta: Any) -> Any:
    """A command's ``--plot`` file: no default, checked by ``plot_path``."""
    return setting(None, help, metavar="PATH", parse=plot_path, **meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_fields(
    parser: argparse.ArgumentParser,
    cls: type,
    only: Iterable[str] | None = None,
    required: bool = False,
) -> None:
    """Add a flag for each of ``cls``'s settings fields (those with help), or for ``only``;
    ``required``: the command cannot run without them."""
    wanted = set(only) if only is not None else None
    groups = {g.title: g for g in parser._action_groups}  # a section across calls is one
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or (wanted is not None and f.name not in wanted):
            continue
        meta = f.metadata
        title = meta.get("group")
        target: argparse._ActionsContainer = parser
        if title is not None:
            target = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        names = (flag_name(f.name), *meta.get("aliases", ()))
        if f.default is True:  # on by default: --name and --no-name, and any negations
            _add_switch(target, names, f)
            continue
        if isinstance(f.default, bool):
            target.add_argument(*names, dest=f.name, action="store_true", help=field_help(f))
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": field_help(f)}
        kwargs |= {"required": True} if required else {}
        parse = meta.get("parse", type(f.default) if f.default is not None else str)
        kwargs["type"] = parse
        for key in ("choices", "metavar"):
            if key in meta:
                kwargs[key] = meta[key]
        target.add_argument(*names, **kwargs)


def _add_switch(
    target: argparse._ActionsContainer, names: tuple[str, ...], f: dataclasses.Field
) -> None:
    """An on-by-default setting: ``--name`` and ``--no-name``, and its ``negations`` (named in
    its help, so listed once)."""
    action = argparse.BooleanOptionalAction
    target.add_argument(*names, dest=f.name, action=action, default=True, help=field_help(f))
    for off in f.metadata.get("negations", ()):
        target.add_argument(off, dest=f.name, action="store_false", help=argparse.SUPPRESS)


def field_help(f: dataclasses.Field) -> str:
    """The field's help with its default, ``%`` escaped for argparse."""
    text, default = f.metadata["help"], f.default
    if default is not None and not isinstance(default, bool):
        shown = ",".join(default) if isinstance(default, tuple) else default
        text = f"{text} (default {shown})"
    return text.replace("%", "%%")


def from_args(cls: type[T], args: argparse.Namespace, **extra: Any) -> T:
    """``cls`` built from the parsed flags it has (fields the command lacks keep defaults)."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and hasattr(args, f.name)
    }
    return cls(**(values | extra))


def switches(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The on-by-default flags of ``parser``'s commands (those with a ``--no-`` form)."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = [parser, *(p for a in commands for p in a.choices.values())]
    return frozenset(
        name
        for p in parsers
        for action in p._actions
        if isinstance(action, argparse.BooleanOptionalAction)
        for name in action.option_strings
        if not name.startswith("--no-")
    )


def expand_config(argv: Sequence[str], switches: Collection[str] = ()) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the flags in FILE (a YAML mapping of flag
    names to values), put just after the subcommand so flags on the command line win;
    ``switches``: flags on by default, which a ``false`` in FILE turns off (``--no-NAME``)."""
    argv = list(argv)
    spots = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not spots:
        return argv
    if len(spots) > 1:
        raise ConfigError("--config may be given once")
    i = spots[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a YAML file of flags")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1 :]
    flags = config_flags(path, switches)
    head = 1 if rest and not rest[0].startswith("-") else 0  # after the subcommand
    return rest[:head] + flags + rest[head:]


def config_flags(path: str, switches: Collection[str] = ()) -> list[str]:
    try:
        import yaml  # only --config needs PyYAML
    except ImportError:
        raise ConfigError("--config needs PyYAML: pip install pyyaml") from None
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path} is not valid YAML: {exc}") from None
    if isinstance(data, dict) and any(key in data for key in HF_CONFIG_KEYS):
        raise ConfigError(
            f"--config {path} looks like a Hugging Face config.json; --config is now a YAML "
            f"file of flags: pass the model config as --hf-config {path}"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a YAML mapping of flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        name = flag_name(str(key).lstrip("-"))
        if value is True:
            flags.append(name)
        elif value is False and name in switches:  # off only by its --no- form
            flags.append("--no-" + name[2:])
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            flags += [name, ",".join(map(str, value))]
        else:
            flags += [name, str(value)]
    return flags
