"""What `kernel_budget.py` writes from its rows: the progress line, budget.json's text, the
Markdown table (budget.md) and benchmarks/RESULTS.md's section with what the budget predicts
for an H100 and an H200."""

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
# the decode kernels a row reads: the Triton kernel, the Gluon whole tiles (kernels.decode_gluon)
KERNELS = {"_decode_split_kernel": "Triton", "_body_kernel": "Gluon"}


# -- the rows -------------------------------------------------------------------------------


def summary(row: dict) -> str:
    where = f"{row['arch']} {row['recipe']} {row['shape']} {row['keys']}" + (
        " paged" if row["paged"] else "") + (f" ({KERNELS[row['kernel']]})" if "kernel" in row
                                             else "")  # fmt: skip
    if "registers" not in row:
        why = "skipped" if "skipped" in row else "FAILED"
        return f"{where}: {why} ({row.get('skipped') or row['failed']})"
    return (f"{where} ({row['block_n']}, {row['num_warps']}, {row['num_stages']})"
            f"{' *' if row['chosen'] else ''}: {row['registers']} regs, {row['spill_bytes']} B "
            f"spilled, {row['warps_per_sm']} warps/SM, loop {row['loop_instructions']} -> "
            f"{row['per_position']}/position (largest loop {row['largest_loop_instructions']} -> "
            f"{row['per_position_largest_loop']})"
            + (f", {row['compile_s']} s" if "compile_s" in row else ", kept"))  # fmt: skip


COLUMNS = ("arch | recipe | shape | keys | paged | kernel | BLOCK_N, warps, stages | regs | "
           "stack B | "
           "spill B | shared KB | warps/SM | programs/SM 4Kx1, 4Kx16, 32Kx1, 32Kx16 | "
           "in flight KB/SM | steady loop instr. | per position | largest loop instr. | per "
           "position, largest loop | LDL+STL in loops | loop loads async / sync")  # fmt: skip


def table(rows: list[dict]) -> list[str]:
    out = ["| " + COLUMNS + " |", "|" + "---|" * 7 + "---:|" * 14]
    for r in rows:
        if "registers" not in r:
            continue
        programs = ", ".join(
            f"{p:.2f}".rstrip("0").rstrip(".") for p in r["programs_per_sm"].values()
        )
        out.append(
            f"| {r['arch']} | {r['recipe']} | {r['shape']} | {r['keys']} | "
            f"{'yes' if r['paged'] else 'no'} | {KERNELS[r['kernel']]} | {r['block_n']}, "
            f"{r['num_warps']}, "
            f"{r['num_stages']}{' *' if r['chosen'] else ''} | {r['registers']} | {r['stack']} | "
            f"{r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} | {r['warps_per_sm']} | "
            f"{programs} | {r['bytes_in_flight_per_sm'] / 1024:.1f} | "
            f"{r['loop_instructions']} | {r['per_position']} | "
            f"{r['largest_loop_instructions']} | {r['per_position_largest_loop']} | "
            f"{r['loop_local']} | "
            f"{r['loop_async_loads']} / {r['loop_sync_loads']} |"
        )  # fmt: skip
    return out


def markdown(doc: dict) -> str:
    skipped = [summary(r) for r in doc["rows"] if "registers" not in r]
    gpus = "; ".join(f"{a}: {g[0]}, {g[1]} SMs" for a, g in doc["gpus"].items())
    return "\n".join([
        f"# Decode-kernel budget (Triton {doc['triton']}, torch {doc['torch']})",
        "",
        "Compiled on a CPU with Triton's bundled tools: "
        + "; ".join(f"{a}: {p}" for a, p in doc["ptxas"].items()) + ".",
        "",
        f"Launch configurations as the launcher picks them on: {gpus}. `*`: the configuration "
        "it launches without tuning (CUDA-graph capture); the others are the candidates it "
        f"times on a GPU. Compiled at {doc['compiled_at']}; programs/SM at each load. "
        "per position = steady loop instructions x warps / BLOCK_N (warp-instructions per "
        "position x KV head); the steady loop is the whole-tile loop (the tagged line's), the "
        "largest loop the first budget's rule (since the masked tail split out: the 16-row "
        "mixed loop, once per program) divided by BLOCK_N likewise; loop loads: "
        "ttg.async_copy_global_to_local / synchronous tensor tt.load inside the TTGIR's "
        "loops. `benchmarks/kernel_budget.py` says how each is read.",
        "",
        *table(doc["rows"]),
        *(["", "Not compiled:", "", *[f"- {s}" for s in skipped]] if skipped else []),
    ])  # fmt: skip


# -- what the budget predicts (benchmarks/RESULTS.md's section) --------------------------------

# (name, SMs, boost clock GHz, HBM TB/s): spec-sheet numbers (H100 SXM5, H200 SXM)
DEVICES = (("H100 SXM", 132, 1.98, 3.35), ("H200", 132, 1.98, 4.8))
SCHEDULERS = 4  # warp schedulers per SM, one warp-instruction issued per clock each
BEGIN, END = "<!-- kernel-budget: begin -->", "<!-- kernel-budget: end -->"


def h200_measured(results: str) -> dict[str, dict[str, float]]:
    """From RESULTS.md's first H200 run: {keys: {"flash": us, "ours": us, "exact": us}} for
    kvcalib-2 at 32/8/128, 32K x 16, fp16, with the full-precision stream timed beside it (its
    bench_decode table: columns found by their headers)."""
    section = results[results.index("## First GPU run: H200") :]
    section = section[: section.index("\n## ", 1)]
    lines = [x for x in section.splitlines() if x.startswith("|")]
    header = next(x for x in lines if "flash us" in x)
    names = [c.strip() for c in header.strip("|").split("|")]
    out = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:4] == ["32/8/128", "32768", "16", "kvcalib-2"] and cells[5] == "float16":
            out[cells[4]] = {key: float(cells[names.index(column)]) for key, column in
                             (("flash", "flash us"), ("ours", "ours graph us"),
                              ("exact", "exact stream us"))}  # fmt: skip
    return out


def results_section(doc: dict, results: str) -> str:
    """RESULTS.md's budget section, from budget.json: kvcalib-2's rows (and the full-precision
    stream's, and kvcalib-3's, -4's and -1.5's Gluon tiles) at 32/8/128 on sm_90, and the
    floors they predict at 32K x 16 on an H100 and an H200 beside what the H200 measured."""

    def shown(r):
        if "registers" not in r or r["paged"] or (r["arch"], r["shape"]) != ("sm_90", "32/8/128"):
            return False
        if r["recipe"] in ("kvcalib-3", "kvcalib-4", "kvcalib-1.5"):
            return r["chosen"] and r["kernel"] == "_body_kernel"
        return r["recipe"] == "kvcalib-2" or (r["recipe"] == "full-precision" and r["chosen"])

    rows = [r for r in doc["rows"] if shown(r)]
    positions = 32768 * 8 * 16
    measured = h200_measured(results)
    fp16_bytes = 2 * positions * 128 * 2
    lines = [
        BEGIN,
        "## The decode kernel's budget, read on a CPU (issue 51)",
        "",
        f"`make kernel-budget` (Triton {doc['triton']}, {doc['ptxas']['sm_90']}; no GPU): "
        "benchmarks/kernel_budget/budget.md has every variant; generated from its budget.json by "
        "`python benchmarks/kernel_budget.py --results`. kvcalib-2 (the preset's first layer: "
        "2-bit static codebook keys with one fp8 exact slot, 2-bit per-token values with "
        "one-byte metadata) at 32/8/128, sm_90, the launch an H100 gets at 32K x 16 "
        "(`*`: untuned; the others are the candidates the launcher times). Its body's whole "
        "tiles are the Gluon kernel's (kernels.decode_gluon); the Triton kernel's rows there "
        "read only what follows them (a partial tile, the ring, the sinks, the new token), so "
        "the Gluon rows predict the step. Listed with them: kvcalib-3's and kvcalib-4's Gluon "
        "tiles (3- and 4-bit codebook keys with an fp16 exact slot, codebook values with an "
        "fp16 scale a row) and kvcalib-1.5's (6-bit indices of 4-channel vectors, no slot):",
        "",
        *table(rows),
        "",
        f"What it predicts for one step at 32K x 16 (32,768 positions x 8 KV heads x 16 "
        f"sequences = {positions / 1e6:.2f} M rows). Instruction floor = per position x rows / "
        f"(SMs x {SCHEDULERS} schedulers x boost clock), at perfect issue; byte floor = bytes "
        "the step reads (every buffer the launch is handed: codes, metadata, slots, ring, "
        "sinks, flags) / HBM bandwidth. Constants: "
        + "; ".join(f"{n}: {s} SMs, {c} GHz, {b} TB/s" for n, s, c, b in DEVICES)
        + f". FlashAttention over fp16 reads {fp16_bytes / 1e9:.2f} GB. Measured: the H200 "
        "run of 2026-12-04 (Triton 3.6, the benchmark's own kvcalib-2 layout then: symmetric "
        "codebook values, exact slots; not today's preset; the full-precision stream's time "
        "is its `exact stream` column). Issue 51's target, 4x flash, is "
        + " and ".join(f"{v['flash'] / 4:.0f} us {k}" for k, v in measured.items())
        + " on the H200.",
        "",
        "| keys | config | device | instruction floor us | byte floor us | predicted floor us "
        "| flash byte floor us | flash measured us (H200) | ours measured us (H200) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in (r for r in rows if r["chosen"]):
        for name, sms, clock, tbs in DEVICES:
            issue = r["per_position"] * positions / (sms * SCHEDULERS * clock * 1e9) * 1e6
            byte = r["bytes_read_32k_x16"] / (tbs * 1e12) * 1e6
            at = measured.get(r["keys"], {}) if name == "H200" else {}
            ours = at.get({"kvcalib-2": "ours", "full-precision": "exact"}.get(r["recipe"]), "")
            if at and r["kernel"] == "_body_kernel":  # written after that run: never timed
                ours = "not run"
            lines.append(
                f"| {r['recipe']} {r['keys']} ({KERNELS[r['kernel']]}) | {r['block_n']}, "
                f"{r['num_warps']}, "
                f"{r['num_stages']} | {name} | {issue:.0f} | {byte:.0f} | {max(issue, byte):.0f} "
                f"| {fp16_bytes / (tbs * 1e12) * 1e6:.0f} | {at.get('flash', '')} | {ours} |"
            )  # fmt: skip
    return "\n".join([*lines, "", END])


def dumps(doc: dict) -> str:
    """budget.json's text: one line per row (a regenerated table diffs row by row)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "rows"}, indent=1)[:-2]
    rows = ",\n".join(json.dumps(r) for r in doc["rows"])
    return f'{head},\n "rows": [\n{rows}\n ]\n}}\n'


def write_results(doc: dict) -> None:
    """benchmarks/RESULTS.md's budget section (between BEGIN and END), replaced, or
    inserted after the first H200 run's section."""
    text = RESULTS.read_text()
    section = results_section(doc, text)
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        at = text.index("\n## ", text.index("## First GPU run: H200")) + 1
        text = text[:at] + section + "\n\n" + text[at:]
    RESULTS.write_text(text)
