"""Delta checkpoints: what a run's stages trained, without the rest of the student.

A student converted from a teacher is, before training, a function of the teacher, the recipe and
its seed: the trained tensors alone (LoRA adapters, feature maps, mixers — whatever each stage's
``trainable`` set held) turn it into the trained student. A run keeps them in ``RUN/delta/``,
rewritten at each stage's end (main process, atomically):

* ``delta.safetensors`` — each finished stage's trained tensors, as ``"<stage>/<name>"`` (LoRA's as
  the adapters' factors ``lora.<layer>.A`` / ``.B``, taken before the stage merges them; a stage's
  training-only modules, dropped at its end, are left out);
* ``delta.json`` — the base it applies to: the teacher, the recipe, the converted layout (each
  layer's kind) and a checksum of the base student's tensors the delta does not replace; per stage
  its name, tensors and LoRA scale; the run's position after the last one; the tensors file's sha256.

``apply_delta`` replays it on a freshly converted student (stage by stage: the stage's tensors
loaded, its LoRA merged as ``lora.merge_lora`` merges) — bitwise the run's student on the device it
trained on, to rounding elsewhere; distill/from_delta.py starts a run from it (``attn2ssm distill
RECIPE --out NEW --from-delta RUN``). A base that differs (another teacher, dtype or layout) is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from attn2ssm.distill.run_dir import writing_to
from attn2ssm.errors import ConfigError
from attn2ssm.paths import atomic_write_bytes, atomic_write_text

DELTA = "delta"  # the folder in a run directory
TENSORS, META = "delta.safetensors", "delta.json"
FORMAT = 1
_SKIP = ("lora.", "stage_modules.")  # never part of the base student


def tensor_hashes(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of each base tensor of ``model`` (its state dict, dtype and shape included)."""
    hashes = {}
    for name, t in model.state_dict().items():
        if name.startswith(_SKIP):
            continue
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        hashes[name] = h.hexdigest()
    return hashes


def base_checksum(hashes: dict[str, str], replaced: set[str]) -> str:
    """One sha256 over the base tensors a delta relies on: all but those it replaces whole."""
    h = hashlib.sha256()
    for name in sorted(set(hashes) - replaced):
        h.update(f"{name}={hashes[name]}\n".encode())
    return h.hexdigest()


def layout(model) -> list[str]:
    """Each layer's kind in the converted student (attention or the mixer)."""
    return list(model.config.layer_plan)


def _replaced(stages: list[dict]) -> set[str]:
    return {n for s in stages for n in s["tensors"] if not n.startswith("lora.")}


@dataclass
class DeltaWriter:
    """A run's delta, kept up to date at each stage's end (``add_stage``)."""

    folder: Path
    meta: dict
    tensors: dict  # "<stage>/<name>" → CPU tensor
    hashes: dict  # the base's tensor hashes

    @classmethod
    def start(cls, out: Path, recipe, student) -> DeltaWriter:
        """A run's delta, begun on its freshly converted ``student`` (no stage trained yet)."""
        meta = {
            "format": FORMAT,
            "teacher": recipe.teacher,
            "recipe": recipe.name,
            "seed": recipe.seed,
            "layout": layout(student),
            "stages": [],
            "state": None,
        }
        return cls(Path(out) / DELTA, meta, {}, tensor_hashes(student))

    @classmethod
    def reopen(cls, out: Path) -> DeltaWriter | None:
        """A resumed run's delta as its earlier stages left it (None: the run kept none)."""
        folder = Path(out) / DELTA
        if not (folder / META).exists():
            return None
        meta = json.loads((folder / META).read_text())
        if "base_tensors" not in meta:
            return None
        tensors = _load_tensors(folder) if meta["stages"] else {}
        return cls(folder, meta, tensors, meta["base_tensors"])

    def add_stage(self, run, state) -> None:
        """Stage ``run`` has finished (its LoRA not merged yet): keep its trained tensors, then
        rewrite the delta. A sharded stage's tensors are not whole here: the delta stops there."""
        if run.sharded or self.meta.get("incomplete"):
            self.meta["incomplete"] = (
                f"stage {run.index + 1} was sharded (FSDP): its tensors are not in the delta"
            )
            self._write()
            return
        params = dict(run.unwrapped.named_parameters())
        names = [n for n in run.param_names if n in params and not n.startswith("stage_modules.")]
        for name in names:
            self.tensors[f"{run.index}/{name}"] = params[name].detach().to("cpu", copy=True).contiguous()
        lora = run.cfg.lora
        self.meta["stages"].append(
            {
                "stage": run.index,
                "name": run.cfg.name,
                "tensors": names,
                "lora_scale": lora.alpha / lora.r if lora is not None else None,
            }
        )
        self.meta["state"] = {
            "stage": state.stage,
            "step": state.step,
            "tokens": state.tokens,
            "total_tokens": state.total_tokens,
            "finished": list(state.finished),
        }
        self._write()

    def _write(self) -> None:
        with writing_to(self.folder.parent, "the delta checkpoint", self.folder):
            self._write_files()

    def _write_files(self) -> None:
        from safetensors.torch import save

        self.folder.mkdir(parents=True, exist_ok=True)
        data = save(self.tensors) if self.tensors else b""
        if data:
            atomic_write_bytes(self.folder / TENSORS, data)
        replaced = _replaced(self.meta["stages"])
        meta = {
            **self.meta,
            "base_checksum": base_checksum(self.hashes, replaced),
            "tensors_sha256": hashlib.sha256(data).hexdigest(),
            "base_tensors": self.hashes,
        }
        atomic_write_text(self.folder / META, json.dumps(meta, indent=1) + "\n")


def start_delta(out: Path, recipe, student, resumed: bool, is_main: bool) -> DeltaWriter | None:
    """The run's delta writer (main process): begun on a freshly built student, or reopened on a
    resume (None when the run kept none)."""
    if not is_main or not hasattr(student.config, "layer_plan"):
        return None
    if resumed:
        return DeltaWriter.reopen(out)
    writer = DeltaWriter.start(out, recipe, student)
    writer._write()
    return writer


def _load_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / TENSORS))


@dataclass
class Delta:
    """A delta read back (``read_delta``)."""

    folder: Path
    meta: dict
    tensors: dict


def delta_folder(source: str | Path) -> Path:
    """The delta folder ``source`` names: a run directory, its ``delta/`` folder, or a file in it."""
    source = Path(source)
    for folder in (source / DELTA, source, source.parent):
        if (folder / META).is_file():
            return folder
    raise ConfigError(
        f"--from-delta {source}: no {DELTA}/{META} there",
        "name a run directory whose stages finished (it keeps RUN/delta/), or that folder itself",
    )


def read_delta(source: str | Path) -> Delta:
    """The delta in ``source`` (``delta_folder``), checked whole: one line when it is not usable."""
    folder = delta_folder(source)
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(
            f"--from-delta {folder}: format {meta.get('format')!r} is not {FORMAT}",
            "write it again with this attn2ssm",
        )
    if meta.get("incomplete"):
        raise ConfigError(
            f"--from-delta {folder}: {meta['incomplete']}",
            "resume that run from its checkpoint instead (--resume)",
        )
    if not meta["stages"]:
        raise ConfigError(
            f"--from-delta {folder}: no stage of that run has finished",
            "let its first stage finish, or resume it with --resume",
        )
    data = (folder / TENSORS).read_bytes() if (folder / TENSORS).exists() else b""
    if hashlib.sha256(data).hexdigest() != meta["tensors_sha256"]:
        raise ConfigError(
            f"--from-delta {folder}: {TENSORS} does not match {META} (damaged or half-copied)",
            "copy the delta folder again",
        )
    return Delta(folder, meta, _load_tensors(folder) if data else {})


def check_base(delta: Delta, recipe, student) -> None:
    """Refuse, in one line, a delta whose base is not ``student`` (built from ``recipe``)."""
    meta, where = delta.meta, f"--from-delta {delta.folder}"
    if meta["teacher"] != recipe.teacher:
        raise ConfigError(
            f"{where}: its base is teacher {meta['teacher']!r}, this recipe's {recipe.teacher!r}",
            "use the delta's teacher",
        )
    if meta["layout"] != layout(student):
        raise ConfigError(
            f"{where}: its base's layout {meta['layout']} is not this student's {layout(student)}",
            "use the delta's recipe and seed",
        )
    got = base_checksum(tensor_hashes(student), _replaced(meta["stages"]))
    if got != meta["base_checksum"]:
        differ = sorted(n for n, h in tensor_hashes(student).items() if meta["base_tensors"].get(n) != h)
        raise ConfigError(
            f"{where}: the base student differs from the delta's ({len(differ)} tensors, first {differ[:1]})",
            "convert with the delta's teacher, teacher_dtype, recipe and seed",
        )


@torch.no_grad()
def apply_delta(student, delta: Delta) -> None:
    """Replay the delta's stages on the converted ``student``, in order: each stage's trained
    tensors loaded, then its LoRA folded in as ``lora.merge_lora`` folds it (W += B·A·scale)."""
    params = dict(student.named_parameters())
    for record in delta.meta["stages"]:
        stage, adapters = record["stage"], {}
        for name in record["tensors"]:
            value = delta.tensors[f"{stage}/{name}"]
            if name.startswith("lora."):
                key, factor = name[len("lora.") :].rsplit(".", 1)
                adapters.setdefault(key, {})[factor] = value
            elif name in params:
                params[name].copy_(value)
        for key, ab in adapters.items():
            linear = student.get_submodule(key.replace("__", "."))
            A, B = (ab[f].to(linear.weight.device, linear.weight.dtype) for f in ("A", "B"))
            linear.weight += (B @ A * record["lora_scale"]).to(linear.weight.dtype)
