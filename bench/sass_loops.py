"""The instructions a compiled kernel's inner loop issues, read from its SASS, by execution pipe.

Used by bench/trellis_bench.py (on the GPU machine, on the kernels it just ran) and
bench/trellis_sm90_compile.py (here, on an sm_90 build without a GPU) to turn a loop's instruction
count into an issue-time bound. A loop is a backward branch; the kernel's main loop is taken as its
longest one.

Pipes and their rates on Hopper, in warp instructions per clock per SM (4 sub-partitions, each issuing
one warp instruction a clock; per sub-partition 32 FP32 lanes, 16 INT32 lanes, 8 load/store units,
4 transcendental/conversion lanes, NVIDIA's H100 whitepaper). Which SASS opcode runs on which pipe is
not documented; the table below follows the profiler's pipe names (alu, fma, fmaheavy, lsu, xu) as
they are usually described, and is a lead, not a measurement:

    issue     4    every instruction
    alu       2    integer and logic: LOP3, SHF, IADD3, PRMT, SEL, ISETP, LEA, SGXT, MOV, ...
    fma       4    FFMA, FADD, FMUL, HADD2, HFMA2, HMUL2 (fp16 pairs on the fp32 lanes)
    fmaheavy  2    IMAD (all forms), IDP (dp4a), IMUL
    lsu       1    LDG, LDS, STS, STG, LDGSTS, LDSM, ...
    xu        0.5  MUFU, I2F, F2I, F2F
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter

RATES = {"issue": 4.0, "alu": 2.0, "fma": 4.0, "fmaheavy": 2.0, "lsu": 1.0, "xu": 0.5}
PIPES = {
    "alu": {"LOP3", "LOP", "SHF", "SHL", "SHR", "IADD3", "IADD", "PRMT", "SEL", "FSEL", "ISETP", "FSETP", "LEA",
            "SGXT", "BMSK", "POPC", "FLO", "BREV", "VIADD", "VIMNMX", "IMNMX", "FMNMX", "PLOP3", "P2R", "R2P", "MOV",
            "IABS", "CS2R"},
    "fma": {"FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "HMUL2", "FMUL2", "FFMA2"},
    "fmaheavy": {"IMAD", "IDP", "IMUL", "IMADSP"},
    "lsu": {"LDG", "LDS", "STS", "STG", "LDGSTS", "LDSM", "STSM", "LD", "ST", "ATOM", "ATOMS", "RED", "LDC"},
    "xu": {"MUFU", "I2F", "F2I", "F2F", "I2FP", "F2IP", "FRND"},
}
_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_OPCODE = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def cuobjdump() -> str | None:
    """The cuobjdump of Triton's wheel, else the one on PATH, else None."""
    try:
        import triton

        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(bundled):
            return bundled
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def sass_of(cubin: bytes) -> str:
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("no cuobjdump (neither Triton's nor on PATH)")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
    try:
        return subprocess.run([tool, "-sass", handle.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(handle.name)


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop (a backward branch's target up to the branch), in order."""
    lines = []
    for line in sass.splitlines():
        match = _LINE.match(line)
        if match:
            lines.append((int(match.group(1), 16), match.group(2).strip()))
    addresses = [address for address, _ in lines]
    best: list[str] = []
    for index, (address, text) in enumerate(lines):
        branch = re.search(r"\bBRA\s+(?:`\()?(?:\.L_x_\d+|0x([0-9a-f]+))", text)
        if branch and branch.group(1) and int(branch.group(1), 16) < address:
            target = addresses.index(int(branch.group(1), 16)) if int(branch.group(1), 16) in addresses else None
            if target is not None and index + 1 - target > len(best):
                best = [_OPCODE.match(body).group(1) for _, body in lines[target:index + 1] if _OPCODE.match(body)]
    return best


def pipe_counts(opcodes: list[str]) -> dict[str, int]:
    """{pipe: instructions} of a loop, "issue" counting all of them; opcodes of no listed pipe count as issue only."""
    counts = Counter(opcodes)
    result = {"issue": sum(counts.values())}
    for pipe, names in PIPES.items():
        result[pipe] = sum(count for name, count in counts.items() if name in names)
    return result


def per_weight(opcodes: list[str], weights_per_thread: float) -> dict[str, float]:
    """Instructions per weight per pipe: each thread issues the loop once per `weights_per_thread` weights."""
    return {pipe: count / weights_per_thread for pipe, count in pipe_counts(opcodes).items()}


def issue_bound_us(instructions_per_weight: dict[str, float], weights: float, sms: int, clock_hz: float) -> dict:
    """{pipe: microseconds} for `weights` weights at the pipes' rates on `sms` SMs at `clock_hz`, and the
    largest as "bound" with its pipe as "limit". A warp instruction covers 32 threads' weights."""
    times = {pipe: instructions_per_weight.get(pipe, 0.0) * weights / 32 / (RATES[pipe] * sms * clock_hz) * 1e6
             for pipe in RATES}
    limit = max(times, key=times.get)
    return {**times, "bound": times[limit], "limit": limit}


def top_opcodes(opcodes: list[str], count: int = 10) -> list[tuple[str, int]]:
    return Counter(opcodes).most_common(count)


def compiled_in_child(code: str, timeout: float = 300.0):
    """Run `code` (Python whose last printed line is JSON) in a child process from the repository's root, without
    TRITON_INTERPRET: an sm_90 build cannot run under the interpreter the tests set. The parsed JSON; a
    RuntimeError with the child's stderr tail when it fails."""
    import json
    import sys
    from pathlib import Path

    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=environment,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the sm_90 build's child exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
