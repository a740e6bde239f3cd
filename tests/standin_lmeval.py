"""A stand-in Hugging Face hub cache for one real lm-eval task's dataset, as ``hf download`` leaves it.

``arc_easy`` reads ``allenai/ai2_arc``, config ``ARC-Easy``. The repository's files are staged under their
real names (``README.md`` whose YAML ``configs:`` maps each config's splits to ``<config>/<split>-*``,
``ARC-Easy/test-00000-of-00001.parquet`` ...), with the real column schema and a handful of original
rows per split, in the cache layout ``$HF_HOME/hub/datasets--allenai--ai2_arc/{refs/main, blobs/,
snapshots/<commit>/}`` (snapshot files are relative links to the blobs, as huggingface_hub makes them).
:func:`stage_arrow_cache` stages instead what an online ``load_dataset`` of the task leaves in the
``datasets`` cache, which ``datasets`` offline resolves the hub id through.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

TASK, REPO, CONFIG = "arc_easy", "allenai/ai2_arc", "ARC-Easy"
COMMIT = "210d026faf9955653af8916fad021475a3f00453"  # any 40-hex id: refs/main names the snapshot folder

README = """\
---
license: cc-by-sa-4.0
pretty_name: Ai2Arc
dataset_info:
- config_name: ARC-Challenge
  features:
  - name: id
    dtype: string
  - name: question
    dtype: string
  - name: choices
    sequence:
    - name: text
      dtype: string
    - name: label
      dtype: string
  - name: answerKey
    dtype: string
- config_name: ARC-Easy
  features:
  - name: id
    dtype: string
  - name: question
    dtype: string
  - name: choices
    sequence:
    - name: text
      dtype: string
    - name: label
      dtype: string
  - name: answerKey
    dtype: string
configs:
- config_name: ARC-Challenge
  data_files:
  - split: train
    path: ARC-Challenge/train-*
  - split: test
    path: ARC-Challenge/test-*
  - split: validation
    path: ARC-Challenge/validation-*
- config_name: ARC-Easy
  data_files:
  - split: train
    path: ARC-Easy/train-*
  - split: test
    path: ARC-Easy/test-*
  - split: validation
    path: ARC-Easy/validation-*
---

# Stand-in for the dataset card of "ai2_arc" (staged by kvcomp's tests)
"""


def _row(uid: str, question: str, answers: list[str], key: str, labels: str = "ABCD") -> dict:
    return {"id": uid, "question": question, "choices": {"text": answers, "label": list(labels[:len(answers)])},
            "answerKey": key}


# original questions in the ARC style (labels A-D, one with 1-4 as some ARC rows have)
ROWS = {
    "ARC-Easy": {
        "test": [
            _row("Standin_E_T1", "Which gas do plants take in from the air to make food?",
                 ["oxygen", "carbon dioxide", "nitrogen", "helium"], "B"),
            _row("Standin_E_T2", "What happens to liquid water when it is cooled below 0 degrees Celsius?",
                 ["it boils", "it freezes", "it evaporates"], "B"),
            _row("Standin_E_T3", "Which tool is best for measuring the mass of a rock?",
                 ["a balance", "a thermometer", "a ruler", "a stopwatch"], "1", labels="1234"),
        ],
        "validation": [
            _row("Standin_E_V1", "Which object in our solar system gives off its own light?",
                 ["the Moon", "Earth", "the Sun", "Mars"], "C"),
            _row("Standin_E_V2", "A magnet will pull on which of these?", ["a paper clip", "a rubber band",
                 "a wooden spoon", "a glass marble"], "A"),
        ],
        "train": [
            _row("Standin_E_R1", "What do roots of a plant mostly do?", ["make seeds", "take in water",
                 "make flowers", "catch sunlight"], "B"),
            _row("Standin_E_R2", "Which of these is a source of renewable energy?", ["coal", "oil", "wind",
                 "natural gas"], "C"),
        ],
    },
    "ARC-Challenge": {
        "test": [_row("Standin_C_T1", "Which process in a cell releases energy stored in glucose?",
                      ["photosynthesis", "respiration", "osmosis", "diffusion"], "B")],
        "validation": [_row("Standin_C_V1", "Which property of a mineral is tested by scratching it on a tile?",
                            ["luster", "streak", "cleavage", "density"], "B")],
        "train": [_row("Standin_C_R1", "Which change is a chemical change?", ["melting ice", "cutting paper",
                       "burning wood", "dissolving sugar"], "C")],
    },
}


@dataclass(frozen=True)
class StagedTask:
    """What :func:`stage_task_dataset` staged: the lm-eval task, its dataset, and the files' snapshot folder."""

    task: str
    repo: str
    config: str
    snapshot: Path
    rows: dict[str, list[dict]]  # split -> the staged rows of ``config``


def stage_task_dataset(hf_home: Path) -> StagedTask:
    """Stage ``allenai/ai2_arc`` (both configs) in the hub cache under ``hf_home`` (``$HF_HOME``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("id", pa.string()), ("question", pa.string()),
        ("choices", pa.struct([("text", pa.list_(pa.string())), ("label", pa.list_(pa.string()))])),
        ("answerKey", pa.string()),
    ])
    repo_dir = Path(hf_home) / "hub" / f"datasets--{REPO.replace('/', '--')}"
    snapshot, blobs = repo_dir / "snapshots" / COMMIT, repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    files = {"README.md": README.encode(), ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n"}
    for config, splits in ROWS.items():
        for split, rows in splits.items():
            sink = pa.BufferOutputStream()
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
            files[f"{config}/{split}-00000-of-00001.parquet"] = sink.getvalue().to_pybytes()
    for name, data in files.items():
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return StagedTask(TASK, REPO, CONFIG, snapshot, ROWS[CONFIG])


def stage_arrow_cache(hf_home: Path, scratch: Path) -> Path:
    """Stage only the Arrow cache that an online ``datasets.load_dataset(REPO, CONFIG)`` prepares
    (``$HF_HOME/datasets/allenai___ai2_arc/ARC-Easy/0.0.0/<commit>/``: ``dataset_info.json`` and
    ``ai2_arc-<split>.arrow``), built by ``datasets`` from a snapshot staged under ``scratch``."""
    import shutil

    import datasets

    snapshot = stage_task_dataset(scratch).snapshot
    builder = datasets.load_dataset_builder(str(snapshot), CONFIG, cache_dir=str(scratch / "datasets"))
    builder.download_and_prepare()
    target = Path(hf_home) / "datasets" / f"{REPO.replace('/', '___')}" / CONFIG / "0.0.0" / COMMIT
    target.mkdir(parents=True)
    for path in Path(builder.cache_dir).iterdir():  # Arrow files are named after the dataset: <name>-<split>.arrow
        shutil.copy(path, target / path.name.replace(f"{snapshot.name}-", f"{REPO.split('/')[1]}-"))
    return target
