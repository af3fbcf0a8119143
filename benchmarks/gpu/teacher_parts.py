"""The teacher's GGUF across the device calls of benchmarks/gpu/distill_on_gpu.py: 86 MiB compressed,
more than one call carries beside the tracked tree, so prepare.sh cuts it into parts (one a call,
each with its SHA-256), ``unpack`` keeps each call's part on the machine, and the last call joins
them where the built-in teacher is looked for, the whole file's SHA-256 checked.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIB = 1 << 20


def split_teacher(gguf: Path, out: Path, part_mib: list[float]) -> None:
    """Here (prepare.sh): the GGUF xz-compressed (kept in ``out`` between runs) and cut into parts of
    ``part_mib`` MiB and a last one with the rest: ``out/partI/`` (I = 1 ..), each with its SHA-256,
    the number of parts and the whole GGUF's SHA-256 (one part travels in each call)."""
    out.mkdir(parents=True, exist_ok=True)
    packed = out / f"{gguf.name}.xz"
    if not packed.exists() or subprocess.run(["xz", "-t", str(packed)]).returncode:
        print(f"compressing {gguf.name} (xz -6: minutes on 2 cores) ...", flush=True)
        with open(packed.with_suffix(".tmp"), "wb") as fh:
            subprocess.run(["xz", "-6", "-T2", "-c", str(gguf)], stdout=fh, check=True)
        packed.with_suffix(".tmp").replace(packed)
    data, cuts = packed.read_bytes(), [0]
    for mib in part_mib:
        cuts.append(min(len(data), cuts[-1] + int(mib * MIB)))
    cuts.append(len(data))
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    for old in out.glob("part*"):
        shutil.rmtree(old)
    for i, (start, end) in enumerate(zip(cuts, cuts[1:])):
        folder, name = out / f"part{i + 1}", f"{gguf.name}.xz.part{i}"
        folder.mkdir()
        (folder / name).write_bytes(data[start:end])
        (folder / "parts.sha256").write_text(f"{hashlib.sha256(data[start:end]).hexdigest()}  ./{name}\n")
        (folder / "gguf.sha256").write_text(f"{digest}  {gguf.name}\n")
        (folder / "count").write_text(f"{len(cuts) - 1}\n")


def keep_parts(work: Path) -> list[int]:
    """The GGUF parts this call carries (.gpu_train/partI/), kept in WORK for the last call, each
    checked (SHA-256); their numbers."""
    kept = []
    for folder in sorted(Path(".gpu_train").glob("part*")):
        n = int(folder.name.removeprefix("part"))
        for f in folder.iterdir():
            target = {"parts.sha256": f"part{n}.sha256", "count": "parts.count"}.get(f.name, f.name)
            (work / target).write_bytes(f.read_bytes())
        if subprocess.run(["sha256sum", "-c", f"part{n}.sha256"], cwd=work).returncode:
            raise SystemExit(f"GGUF part {n} is damaged (its SHA-256 differs): run prepare.sh again")
        kept.append(n)
    return kept


def join_gguf(work: Path, cache: Path) -> Path:
    """The last call: the parts kept by the calls before and this call's, joined where the built-in
    teacher is looked for (CACHE/teachers/smollm2-135m/), the whole file's SHA-256 checked."""
    keep_parts(work)
    count = int((work / "parts.count").read_text()) if (work / "parts.count").exists() else 0
    parts = [work / f"{GGUF}.xz.part{i}" for i in range(count)]
    missing = [i + 1 for i, p in enumerate(parts) if not p.exists()] if count else [1]
    if missing:
        raise SystemExit(
            f"run: GGUF part {missing[0]} is missing: the call carrying .gpu_train/part{missing[0]} did not run "
            "on this machine (run it, unpack, then this call)"
        )
    dest = cache / "teachers" / "smollm2-135m"
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / GGUF, "wb") as out:
        cat = subprocess.Popen(["cat", *map(str, parts)], stdout=subprocess.PIPE)
        xz = subprocess.run(["xz", "-d"], stdin=cat.stdout, stdout=out)
        cat.stdout.close()
        if cat.wait() or xz.returncode:
            raise SystemExit("run: the GGUF's parts do not decompress (xz): run prepare.sh again")
    if subprocess.run(["sha256sum", "-c", str((work / "gguf.sha256").resolve())], cwd=dest).returncode:
        raise SystemExit("run: the joined GGUF's SHA-256 differs: run prepare.sh again")
    return dest / GGUF
