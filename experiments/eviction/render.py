"""The eviction experiment as Markdown and one rate-distortion plot per model: presses alone, codecs alone
and their compositions on one axis, the bits per value of every token the window brought (evicted ones included).

    python scripts/render_tables.py eviction multirun/eviction [--out FILE] [--plot-dir DIR]

Reads every perplexity ``results.json`` below the folder (finished members of every eviction sweep; a sweep still
running renders the rows it has). A row is named by its press (name and ratio) and codec option; its rate is
``bits_per_value_seen`` (rows without a press: ``bits_per_value_measured``, every token held); its distortion the
perplexity of the tokens after the context (``ppl_context``) and its change from the model's fp16 row. The embedded
models run in float32, which doubles what full-precision tokens cost; ``bits seen at 16-bit`` counts them at 16 bits
(what a bf16 deployment would hold: the encoded share at its code bits, the rest at 16, per-sequence state as is),
the axis on which matched bytes are read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcomp.errors import existing_directory
from kvcomp.plots import log_axis, spread_labels
from kvcomp.results import emit, parse_overrides


def load_rows(directory: str | Path) -> list[dict]:
    """One dict per evaluated row of every finished member: ``model``, ``press``, ``ratio``, ``codec`` (the swept
    option), ``bits`` (per value seen), ``held_bits`` (per value held), ``ppl`` and ``fp16`` (the model's reference)."""
    rows = []
    for path in sorted(Path(directory).rglob("results.json")):
        data = json.loads(path.read_text())
        swept = parse_overrides(data.get("overrides", []))
        config = data["config"]
        press = config.get("press", {}).get("name", "none")
        if config.get("press", {}).get("decoding_size"):  # pressed while decoding too
            press += f" decoding {config['press']['decoding_size']}+{config['press'].get('decoding_interval', 64)}"
        if config.get("press", {}).get("head_budgets") == "adakv":  # budgets per head
            press += " adakv"
        if "ppl_context" not in data["rows"][0]:  # another benchmark's member (eviction/ruler)
            continue
        fp16 = next(r for r in data["rows"] if r["codec"].startswith("fp16") and "press" not in r)
        for r in data["rows"]:
            if r is fp16:
                continue
            bits = r.get("bits_per_value_seen", r["bits_per_value_measured"])
            rows.append({"model": r["model"], "press": press, "ratio": r.get("press_ratio", 0.0),
                         "codec": swept.get("codec", config["codec"]["name"]), "bits": bits,
                         "bits16": bits * at_16_bits(r) / r["bits_per_value_measured"],
                         "held_bits": r["bits_per_value_measured"], "ppl": r["ppl_context"], "fp16": fp16["ppl_context"]})
    return rows


def at_16_bits(row: dict) -> float:
    """A row's measured bits per value held with its full-precision tokens counted at 16 bits."""
    share = row["encoded_share"]
    return share * row["code_bits_per_value"] + (1 - share) * 16 + row["state_bits_per_value"]


def kind(row: dict) -> str:
    return "composed" if row["press"] != "none" and row["codec"] != "fp16" else "eviction" if row["press"] != "none" else "quantization"


def render(directory: str | Path) -> str:
    rows = load_rows(directory)
    out = []
    for model in sorted({r["model"] for r in rows}):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: (r["bits16"], r["ppl"]))
        out += [f"### {model}", "", f"{len(mine)} rows; fp16 ppl_context {mine[0]['fp16']:.3f} (32 bits per value "
                "seen: the embedded models run in float32; 16 at 16-bit).", "",
                "| kind | press | ratio | codec | bits seen at 16-bit | bits seen | bits held | ppl_context | vs fp16 |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            press = f"`{r['press']}`" if r["press"] != "none" else "-"
            out.append(f"| {kind(r)} | {press} | {r['ratio']:.2f} | `{r['codec']}` | {r['bits16']:.2f} | {r['bits']:.2f} | "
                       f"{r['held_bits']:.2f} | {r['ppl']:.3f} | {100 * (r['ppl'] / r['fp16'] - 1):+.1f} % |")
        out.append("")
    return "\n".join(out) if out else f"(no finished run below {directory})\n"


SHORT = {"expected_attention": "exp. attention", "streaming_llm": "streamingllm", " decoding ": " dec. "}


def short(label: str) -> str:
    """A plot label with the longest press names shortened."""
    for long, brief in SHORT.items():
        label = label.replace(long, brief)
    return label


def plot(directory: str | Path, plot_dir: Path) -> list[Path]:
    """``eviction_<model>.png``: perplexity against bits per value seen, one marker per kind of row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, paths = load_rows(directory), []
    markers = {"eviction": "o", "quantization": "s", "composed": "^"}
    for model in sorted({r["model"] for r in rows}):
        fig, ax = plt.subplots(figsize=(8, 5.5))
        mine = [r for r in rows if r["model"] == model]
        labelled = []
        for k, marker in markers.items():
            points = [r for r in mine if kind(r) == k]
            ax.scatter([r["bits16"] for r in points], [r["ppl"] for r in points], marker=marker, label=k)
            for r in points:
                press = r["press"] if not r["ratio"] else f"{r['press']} {r['ratio']:g}"
                label = r["codec"] if r["press"] == "none" else press + (
                    "" if r["codec"] == "fp16" else f" + {r['codec']}")
                labelled.append((r["bits16"], r["ppl"], short(label)))
        ax.axhline(mine[0]["fp16"], color="grey", linestyle=":", label="fp16")
        ax.set_xscale("log", base=2)
        low, high = min(r["bits16"] for r in mine), max(r["bits16"] for r in mine)
        ax.set_xlim(low / 1.15, high * 1.9)  # room for the labels of the last column
        ax.set_xlabel("bits per value seen, full precision at 16 bits (evicted tokens included)")
        collapsed = max(r["ppl"] for r in mine) > 2 * mine[0]["fp16"]  # a log scale keeps the other rows apart
        if collapsed:
            log_axis(ax)
        ax.set_ylabel("perplexity after the context" + (" (log scale)" if collapsed else ""))
        ax.set_title(f"Eviction and quantization on one byte axis: {model}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        spread_labels(ax, labelled)
        path = plot_dir / f"eviction_{model}.png"
        fig.savefig(path, dpi=130)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=existing_directory, help="the folder of the eviction sweeps, e.g. multirun/eviction")
    parser.add_argument("--out", type=Path, help="write the Markdown here (atomically) instead of printing it")
    parser.add_argument("--plot-dir", type=Path, help="also draw one rate-distortion plot per model here")
    args = parser.parse_args(argv)
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        plot(args.directory, args.plot_dir)
    return emit(render(args.directory), args.out)


if __name__ == "__main__":
    main()
