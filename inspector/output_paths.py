"""Every path a command writes, checked before any work, and written so that a failure is one line.

    check_output_path(args.results, "--results", protect={"the session file": args.session})
    write_output(path, text, "--results")   # atomic; an OSError becomes a UserError

A path is refused (UserError, exit 2, before anything runs) when it is empty; when it is, or links
to, a file that must not be overwritten (`protect`: the session being run, its results file as
the report, the recording a replay reads; compared by inode, so symbolic and hard links count);
when it is a file a load of the checkpoint directory holding it reads (a *.safetensors shard,
config.json, the tokenizer: an output there would break the model, or join its weights); when
it is a directory or another non-regular file (a device, a FIFO: a rename would replace the
node itself); when an existing file is read-only (its owner meant to keep it); when its directory
does not exist, is not a directory, or does not take a new file (checked by creating and removing
an unnamed, else a hidden, file there, which also catches read-only filesystems and full quotas).
Two outputs of one command must differ too (`distinct_outputs`). An option that writes one format
(`ENDINGS`: --trace JSON, --record-routing safetensors, ...) takes only a name ending in it: nothing is
written in a format its name does not say (docs/cli-and-tui-conventions.md); options whose format follows
the name or --format (--report) are checked by `inspector.commands.output.format_for_path`.

Used by every command that writes: run (results, report), bench (--json-out), sweep
(calibration), the TUI (--session, its results file, ctrl+s). Knows nothing of what is written.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Mapping

from engine.atomic_file import TEMP_SUFFIX, atomic_write_bytes
from engine.errors import UserError
from engine.printable import printable


# The one ending each single-format output option's file must have (the option as commands name it).
ENDINGS = {"--trace": ".json", "--record-routing": ".safetensors", "--json-out": ".json", "--csv": ".csv",
           "--results": ".jsonl"}


def _same_file(path: Path, other: Path) -> bool:
    try:
        return os.path.samefile(path, other)
    except OSError:  # either does not exist (yet): compare where they would resolve
        try:
            return path.resolve() == other.resolve()
        except (OSError, RuntimeError):
            return False


def _probe_directory(directory: Path) -> None:
    """Create and remove a file in `directory`; OSError when the directory takes no new file."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is not None:
        try:
            descriptor = os.open(directory, flag | os.O_WRONLY, 0o600)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        else:
            os.close(descriptor)
            return
    probe = directory / f".moe-inspector-probe-{os.getpid()}{TEMP_SUFFIX}"
    descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(descriptor)
    os.unlink(probe)


# What a checkpoint directory's load reads besides *.safetensors (engine.hf_loader, engine.trellis_checkpoint), and
# the files the other readers of a Hugging Face checkpoint take from it.
CHECKPOINT_FILES = frozenset({"config.json", "tokenizer.json", "model.safetensors.index.json", "quantization.json",
                              "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"})


def _checkpoint_file(path: Path) -> bool:
    """Whether `path` is (or would become) a file a load of the checkpoint directory holding it reads: a weight
    shard, its index, config.json, the tokenizer (and its config), a trellis report. Other files beside a checkpoint (a session and
    its results, a report) are the user's to write."""
    name = path.name.lower()
    if name not in CHECKPOINT_FILES and not name.endswith(".safetensors"):
        return False
    try:
        return (path.parent / "config.json").is_file()
    except OSError:
        return False


def check_output_path(path: str | os.PathLike | None, option: str,
                      protect: Mapping[str, str | os.PathLike | None] | None = None, calibration: bool = False) -> Path:
    """The path, checked as the module docstring says; `option` names it in messages (`--results`). Never the
    calibration file moe_gate=measured reads, unless `calibration` (sweep, which merges its entries into it)."""
    text = "" if path is None else os.fspath(path)
    if not text.strip():
        raise UserError(f"{option}: an empty path; give a file name")
    if "\x00" in text:
        raise UserError(f"{option} {printable(text)!s}: a path cannot hold a NUL character")
    path = Path(text).expanduser()
    shown = printable(str(path))
    from engine.calibration import calibration_path

    # the calibration file moe_gate=measured reads (and only sweep writes, merging): no command's output
    always = {} if calibration else {
        "the calibration file moe_gate=measured reads (MOEI_CALIBRATION or its default)": calibration_path()}
    for what, other in {**(protect or {}), **always}.items():
        if other is not None and _same_file(path, Path(other).expanduser()):
            raise UserError(f"{option} {shown}: that is {what}, which this command must not overwrite; "
                            f"give another file name")
    try:
        status = os.stat(path)
    except FileNotFoundError:
        status = None
    except NotADirectoryError:
        raise UserError(f"{option} {shown}: a part of the path above the file is not a directory; "
                        f"check the path") from None
    except OSError as error:
        raise UserError(f"{option} {shown}: cannot be checked ({error.strerror}); pick another path") from None
    if status is not None:
        if stat.S_ISDIR(status.st_mode):
            raise UserError(f"{option} {shown}: is a directory; name a file inside it")
        if not stat.S_ISREG(status.st_mode):
            raise UserError(f"{option} {shown}: is not a regular file (a device, a socket or a pipe); "
                            f"name a plain file")
        if not status.st_mode & 0o222:
            raise UserError(f"{option} {shown}: the file is read-only; make it writable (chmod u+w) or "
                            f"give another file name")
    directory = path.parent
    if not directory.exists():
        raise UserError(f"{option} {shown}: the directory {printable(str(directory))} does not exist; "
                        f"create it first (mkdir -p) or pick another place")
    if not directory.is_dir():
        raise UserError(f"{option} {shown}: {printable(str(directory))} is not a directory; check the path")
    if _checkpoint_file(path):
        raise UserError(f"{option} {shown}: a file a load of the checkpoint {printable(str(directory))} reads; "
                        f"writing it would break that model: name a file outside it, or not a weight, config or "
                        f"tokenizer file")
    try:
        _probe_directory(directory)
    except OSError as error:
        raise UserError(f"{option} {shown}: cannot create a file in {printable(str(directory))} "
                        f"({error.strerror}); pick a writable directory") from None
    ending = ENDINGS.get(option)
    if ending is not None and path.suffix.lower() != ending:
        said = f"ends in {printable(path.suffix, 20)!s}" if path.suffix else "has no extension"
        raise UserError(f"{option} {shown}: the name {said}, and {option} writes {ending[1:]}; name the file "
                        f"*{ending}")
    return path


def distinct_outputs(outputs: Mapping[str, str | os.PathLike | None]) -> None:
    """Two outputs of one command (e.g. --report and --results) must not be the same file."""
    named = [(option, Path(path).expanduser()) for option, path in outputs.items() if path]
    for index, (option, path) in enumerate(named):
        for other_option, other in named[index + 1:]:
            if _same_file(path, other):
                raise UserError(f"{option} and {other_option} name the same file ({printable(str(path))}): "
                                f"one would overwrite the other; give them different names")


def write_output(path: str | os.PathLike, data: str | bytes, option: str) -> Path:
    """Write atomically; a failure (a full disk, a directory removed meanwhile) is one UserError line,
    and then the file is as it was."""
    path = Path(path)
    try:
        atomic_write_bytes(path, data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as error:
        raise UserError(f"{option} {printable(str(path))}: could not be written ({error.strerror or error}); "
                        f"the file is as it was; free space or pick another place") from None
    return path
