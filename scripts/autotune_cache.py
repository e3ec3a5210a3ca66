"""FLA's autotuning results kept between GPU runs, per GPU model (scripts/compare_modules.py
--autotune-cache DIR).

fla-core's kernels autotune on their first call at each key: minutes of a device session before
the first timing. Triton can keep each kernel's tuning timings on disk (knobs.autotuning.cache,
TRITON_CACHE_AUTOTUNING) as `<its cache dir>/<key hash>/<kernel>.autotune.json`, and a later
process with the same Triton, kernel source and tuning key reads the best config from there
instead of benchmarking again. A GPU machine starts bare, so `seed` copies the files a previous
run collected into Triton's cache before FLA is imported, and `collect` copies them back out
(DIR/<GPU model>/<key hash>/...: the key hash names the target's architecture, not the model,
and an H100's choices are not an H200's). lrdsl's own kernels do not autotune: this changes
nothing of theirs.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

SUFFIX = ".autotune.json"


def model_folder(store: Path, device_name: str) -> Path:
    """DIR/<GPU model>, the model's name made a folder name ("NVIDIA H200" -> NVIDIA_H200)."""
    return store / re.sub(r"[^A-Za-z0-9._-]+", "_", device_name.strip())


def _copy_results(source: Path, target: Path) -> int:
    """Copies every <hash>/<kernel>.autotune.json under `source` to the same place under
    `target`; returns how many."""
    count = 0
    for path in sorted(source.glob(f"*/*{SUFFIX}")):
        destination = target / path.parent.name / path.name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, destination)
        count += 1
    return count


def seed(store: Path, device_name: str, triton_cache: Path) -> int:
    """Puts the results collected for this GPU model into Triton's cache; returns how many."""
    folder = model_folder(store, device_name)
    return _copy_results(folder, triton_cache) if folder.is_dir() else 0


def collect(store: Path, device_name: str, triton_cache: Path) -> int:
    """Copies the tuning results in Triton's cache out to DIR/<GPU model>; returns how many."""
    return _copy_results(triton_cache, model_folder(store, device_name)) if triton_cache.is_dir() else 0
