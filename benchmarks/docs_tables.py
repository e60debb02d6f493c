"""Every results table in README.md and docs/, written from the committed JSON records.

    python benchmarks/docs_tables.py            rewrite each block in place (`make docs`)
    python benchmarks/docs_tables.py --check    exit 1 naming each block that differs

A block is the text between `<!-- docs:NAME -->` and `<!-- /docs:NAME -->` in a Markdown file;
BLOCKS maps NAME to the function that renders it. Only the standard library and JSON are read
(no kvcalib, no torch), so the check is fast.

Where the numbers come from:
- benchmarks/leaderboard.json (`make leaderboard`): SmolLM2-135M, 4 windows x 1,024 tokens per
  text, residual 128 for every recipe ("same-window"), decode and fake mode. Rows written since
  presets carry a version (2026-12-06) carry it and their plan digest; the rows of 2026-11-30
  carry neither, and their kvcalib-2 rows are the recipe before 2026-12-04 (STALE): never shown.

Each row names its record and the recipe it was measured under: "v1 · <plan digest>" from a
record that carries them, else the date of a record that predates versions (RECORDED;
CHANGELOG.md says what each preset was that day).
- benchmarks/kvcalib-2-values/*.json (2026-12-04, `kvcalib eval --json`): kvcalib-2 as it is
  today on the same windows, and Gemma's and Qwen's decode tables.
- benchmarks/long_context/<model>/long_context*.json and cells/ (`make long-context`): the
  long-context suite; each cell records every calibrated recipe's plan digest.
- benchmarks/calibration-cost/<model>.json (`benchmarks/bench_calibrate.py --json`): the default
  calibration timed against a plain forward over its calibration tokens, back to back; and what
  its retrieval prompts' count does to kvcalib-2 on Qwen2.5: calibration-cost/prompts-kl/ (prose
  KL) and long_context/qwen2.5-0.5b/long_context_probe8.json (`--against`, paired); its cost
  model's predictions, calibration-cost/predicted.json (`benchmarks/calibration_cost.py --json`).
- benchmarks/sessions/<model>/sessions.json (`benchmarks/session.py`): the long chat sessions.
- long_context/qwen2.5-0.5b/long_context_vq.json (`--pair`) and
  kvcalib-1.5-ablation/slots/eval_python_docs_qwen2.5-0.5b.json (`kvcalib eval --json`), both
  under long_context/qwen2.5-0.5b/profile-vq: the vector codes with and without an exact slot.
- benchmarks/kernel_budget/budget.json and floor.json (`make kernel-budget`, `make
  kernel-floor`): the decode kernel's loop and its skeletons compiled for sm_90 on a CPU.
- benchmarks/dtype/bf16_smollm2.json (`benchmarks/dtype/run.sh`): the main table's recipes in
  bfloat16 and float32 on the same windows, kvcalib's through its converted folder scored
  against the source model at that dtype (the main table's bf16 column).
"""

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import budget_report as report  # noqa: E402  (stdlib and JSON only)

VALUES = BENCH / "kvcalib-2-values"
LC = BENCH / "long_context"
DTYPE = BENCH / "dtype" / "bf16_smollm2.json"
COST = BENCH / "calibration-cost"
PREDICTED = COST / "predicted.json"  # calibration_cost.py --json: the cost model, not a record
STALE = {"kvcalib-2"}  # recipes changed since the version-less leaderboard.json was measured
# The date of each record that predates preset versions (its rows carry no version).
RECORDED = {"leaderboard.json": "2026-11-30", "kvcalib-2-values": "2026-12-04"}
OURS = ("kvcalib-1.5", "kvcalib-2", "kvcalib-3", "kvcalib-4")
TEXTS = {"pydoc": "python-docs", "licenses": "licenses", "chat": "chat"}
TASKS = ("passkey", "multikey", "multivalue", "vartrack", "freqwords")
MAIN = ("fp16", "kivi-2", "kvquant-2", "turboquant-2.5", "kvcalib-2", "kvcalib-3", "kvcalib-4")
ORDER = (
    "per-token-2", "kvquant-2", "kvcalib-2", "kivi-2", "turboquant-2.5", "hf-quanto-2",
    "per-token-4", "kvquant-3", "kvcalib-3", "turboquant-3.5", "quarot-kv4", "llamacpp-q4_0",
    "hf-quanto-4", "kvcalib-4", "kivi-4",
)  # fmt: skip


def _load(path: Path):
    return json.loads(path.read_text())


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score 95% interval of k successes in n."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _bold(name: str, cells: list[str]) -> list[str]:
    if name not in OURS:
        return [name, *cells]
    return [f"**{name}**", *(f"**{c}**" if c not in ("", "–") else c for c in cells)]


def _table(head: list[str], align: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


# --- prose-text tables (SmolLM2) ----------------------------------------------------------------


def text_rows(text: str) -> dict[tuple[str, str], dict]:
    """(recipe, mode) -> record for SmolLM2 on `text`, residual 128 for all: the leaderboard's,
    where a version-less STALE row is replaced by its 2026-12-04 record."""
    board = _load(BENCH / "leaderboard.json")["rows"]
    rows = {
        (r["recipe"], r["mode"]): {**r, "source": "leaderboard.json"}
        for r in board
        if r["table"] in ("same-window", "fake") and r["text"] == text  # passkey rows: no text
        and ("version" in r or r["recipe"] not in STALE)
    }  # fmt: skip
    for mode, prefix in (("decode", "kl"), ("fake", "fake")):
        path = VALUES / f"{prefix}_smollm2_{TEXTS[text]}.json"
        for r in _load(path):
            if r["recipe"] in STALE:
                rows.setdefault(
                    (r["recipe"], mode), {**r, "source": f"kvcalib-2-values/{path.name}"}
                )
    return rows


def measured(r: dict) -> str:
    """The recipe a row was measured under: its version and plan digest, or its record's date."""
    if "version" in r:
        return f"v{r['version']} · {r['plan']}"
    return RECORDED[r["source"].split("/")[0]]


def record(r: dict) -> str:
    return f"`{r['source']}` ({measured(r)})"


def _num(r: dict | None, key: str, fmt: str) -> str:
    return "–" if r is None else format(r[key], fmt)


def render_text(text: str) -> str:
    rows = text_rows(text)
    fp = rows[("fp16", "decode")]
    out = []
    for name in ORDER:
        dec, fake = rows.get((name, "decode")), rows.get((name, "fake"))
        if dec is None:
            continue
        cells = [
            f"{dec['bits_per_element']:.2f}",
            f"{dec['bits_at_context']['4096']:.2f}",
            _num(dec, "delta_ppl", "+.3f"),
            _num(dec, "kld", ".4f"),
            _num(fake, "delta_ppl", "+.3f"),
            _num(fake, "kld", ".4f"),
        ]
        out.append([*_bold(name, cells), record(dec)])
    head = ["recipe", "bits/elem", "at 4K", "decode Δppl", "decode KL", "fake Δppl", "fake KL"]
    caption = f"fp ppl {fp['ppl_fp']:.2f}; {fp['setup']['data']}"
    return caption + "\n\n" + _table([*head, "record"], ["---", *["---:"] * 6, "---"], out)


def render_decode(model: str) -> str:
    """Gemma's or Qwen's decode table: every record in kvcalib-2-values/ for `model` at today's
    presets (variants are left to the dated notes)."""
    texts = ("python-docs", "licenses")
    recs: dict[str, dict[str, dict]] = {}
    for text in texts:
        for suffix in ("", "_peers"):
            path = VALUES / f"kl_{model}_{text}{suffix}.json"
            if path.exists():
                for r in _load(path):
                    source = f"kvcalib-2-values/{path.name}"
                    recs.setdefault(r["recipe"], {})[text] = {**r, "source": source}
    out = []
    for name in ORDER:
        if name not in recs or set(recs[name]) != set(texts):
            continue
        by = recs[name]
        cells = [f"{by['python-docs']['bits_per_element']:.2f}"]
        for text in texts:
            cells += [f"{by[text]['delta_ppl']:+.3f}", f"{by[text]['kld']:.4f}"]
        out.append(
            [*_bold(name, cells), "; ".join(dict.fromkeys(measured(r) for r in by.values()))]
        )
    head = ["recipe", "bits/elem", "Python Δppl", "Python KL", "licenses Δppl", "licenses KL",
            "measured"]  # fmt: skip
    setup = next(iter(recs.values()))["python-docs"]["setup"]
    caption = (
        f"{setup['model']}, {setup['windows']} windows x {setup['seq_len']} tokens per text, "
        f"{setup['mode']} mode, residual {setup['residual']} for all"
    )
    return caption + "\n\n" + _table(head, ["---", *["---:"] * 5, "---"], out)


# --- long context -------------------------------------------------------------------------------


def plans(folder: Path) -> dict[str, str]:
    """recipe -> the plan digest its records under folder/cells carry ("mixed" when several);
    a record written before profile-free recipes' records carried one, the plan
    folder/legacy-plans.json names for it (benchmarks/long_context.py)."""
    legacy = folder / "legacy-plans.json"
    old = _load(legacy) if legacy.exists() else {}
    seen: dict[str, set] = {}
    for cell in folder.glob("cells/*/*.json"):
        for name, record in _load(cell)["recipes"].items():
            plan = record.get("plan") or old.get(name)
            if plan:
                seen.setdefault(name, set()).add(plan)
    return {name: next(iter(d)) if len(d) == 1 else "mixed" for name, d in seen.items()}


def lc_report(folder: str, name: str = "long_context") -> dict:
    return _load(LC / folder / f"{name}.json")


def pooled(row: dict) -> tuple[int, int]:
    """Correct answers and prompts over every task and length of one recipe's row."""
    k = n = 0
    for lengths in row["long_context"].values():
        for cell in lengths.values():
            k += round(cell["accuracy"] * cell["samples"])
            n += cell["samples"]
    return k, n


def _pct(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{100 * k / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def render_lc(folder: str, name: str = "long_context") -> str:
    report, digests = lc_report(folder, name), plans(LC / folder)
    rows = report["rows"]
    recipes = [r["recipe"] for r in rows]
    lengths = sorted({int(n) for r in rows for t in r["long_context"].values() for n in t})
    out = []
    for task in TASKS:
        for length in lengths:
            cells = [r["long_context"].get(task, {}).get(str(length)) for r in rows]
            if not any(cells):
                continue
            n = next(c["samples"] for c in cells if c)
            shown = [
                "–" if c is None else
                f"{100 * c['accuracy']:.0f}% [{100 * c['low']:.0f}, {100 * c['high']:.0f}]"
                for c in cells
            ]  # fmt: skip
            out.append([task, str(length), str(n), *shown])
    all_ = [pooled(r) for r in rows]
    out.append(["**all**", "", str(all_[0][1]), *(_pct(k, n) for k, n in all_)])
    out.append(["plan", "", "", *(digests.get(r, "–") for r in recipes)])
    head = ["task", "tokens", "n", *recipes]
    table = _table(head, ["---", "---:", "---:", *["---:"] * len(recipes)], out)
    return report["setup"] + ".\n\n" + table


# --- README -------------------------------------------------------------------------------------


def dtype_rows(dtype: str) -> dict[str, dict]:
    """recipe -> its record at `dtype` in DTYPE (a converted folder's "NAME (converted)" as
    NAME)."""
    return {r["recipe"].removesuffix(" (converted)"): r for r in _load(DTYPE)[dtype]}


def _dtype_kl(bf16: dict | None, fp32: dict | None) -> str:
    """bf16 KL with the same run's float32 KL in brackets; "–" where the bf16 run has none."""
    if bf16 is None:
        return "–"
    return f"{bf16['kld']:.4f} ({_num(fp32, 'kld', '.4f')})"


def render_main() -> str:
    text = text_rows("pydoc")
    bf16, fp32 = dtype_rows("bfloat16"), dtype_rows("float32")
    qwen = lc_report("qwen2.5-0.5b")
    lc = {r["recipe"]: pooled(r) for r in qwen["rows"]}
    digests = plans(LC / "qwen2.5-0.5b")
    n = next(iter(lc.values()))[1]
    out = []
    for name in MAIN:
        r = text[(name, "decode")]
        cells = [
            f"{r['bits_per_element']:.2f}",
            f"{r['kld']:.4f}",
            f"{r['delta_ppl']:+.3f}",
            _dtype_kl(bf16.get(name), fp32.get(name)),
            _pct(*lc[name]) if name in lc else "–",
        ]
        out.append([*_bold(name, cells), digests.get(name, "–"), record(r)])
    head = ["recipe", "bits/elem", "decode KL", "decode Δppl", "decode KL, bf16 (fp32)",
            f"Qwen 4K accuracy, n {n} [95% CI]", "plan (Qwen)", "record"]  # fmt: skip
    return _table(head, ["---", *["---:"] * 5, "---", "---"], out)


def render_headline() -> str:
    rows = {r["recipe"]: pooled(r) for r in lc_report("qwen2.5-0.5b")["rows"]}
    n = rows["fp16"][1]

    def pct(name):
        k, m = rows[name]
        return f"{100 * k / m:.1f}%"

    return (
        f"On Qwen2.5-Coder-0.5B at 4K tokens (a RULER-style suite, n {n} prompts), kvcalib-2 "
        f"answers {_pct(*rows['kvcalib-2'])} against full precision's {_pct(*rows['fp16'])}; "
        f"kivi-2 {pct('kivi-2')}, turboquant-2.5 {pct('turboquant-2.5')}."
    )


def render_sources() -> str:
    """The sentence on where the SmolLM2 rows come from: while leaderboard.json's kvcalib-2 rows
    are version-less (STALE), what stands in for them and what they showed."""
    row = text_rows("pydoc")[("kvcalib-2", "decode")]
    if "version" in row:
        return "Every SmolLM2 row was measured by `make leaderboard` under the version it names."
    board = _load(BENCH / "leaderboard.json")["rows"]
    [old] = [r for r in board if r["recipe"] == "kvcalib-2" and r["text"] == "pydoc"
             and r["table"] == "same-window"]  # fmt: skip
    return (
        f"`benchmarks/leaderboard.json` ({RECORDED['leaderboard.json']}) predates kvcalib-2's "
        f"change of values on 2026-12-04, so kvcalib-2's rows come from its records of "
        f"{RECORDED['kvcalib-2-values']}, and `benchmarks/leaderboard.md` is stale for kvcalib-2 "
        f"(its decode KL {old['kld']:.4f} on the Python documentation is the earlier recipe's); "
        "`make leaderboard` measures every row again with today's presets."
    )


def render_cost() -> str:
    """The default calibration against a plain forward, a row per committed record."""
    rows = []
    for path in sorted(set(COST.glob("*.json")) - {PREDICTED}):
        r = _load(path)
        forward = min(r["forward_seconds"])
        phases = ", ".join(
            f"{k} {v:.0f}" for k, v in r["phases"].items() if v >= 1 and k != "total"
        )
        rows.append([
            r["model"], r["date"], r["machine"], str(r["settings"]["retrieval_prompts"]),
            f"{forward:.1f}", f"{r['calibrate_seconds']:.0f}", f"**{r['ratio']:.2f}×**",
            f"{min(r['load']):.1f}–{max(r['load']):.1f}", phases,
        ])  # fmt: skip
    rows.sort(key=lambda r: (r[0], r[2] != "otherwise idle"))
    head = ["model", "date", "machine", "prompts", "forward s", "calibrate s", "ratio", "load",
            "phases, s"]  # fmt: skip
    return _table(head, ["---", "---", "---", "---:", "---:", "---:", "---:", "---", "---"], rows)


def render_vq() -> str:
    """kvcalib-1.5s (the retired vector-code variant with an exact slot) on Qwen2.5's 4K suite
    beside kvcalib-1.5, kivi-2 and fp16 on the same prompts (long_context_vq.json: its table
    and its --pair rows, every task pooled and passkey), and their prose KL under the same
    profile (kvcalib-1.5-ablation/slots/eval_python_docs_qwen2.5-0.5b.json)."""
    doc = lc_report("qwen2.5-0.5b", "long_context_vq")
    lines = []
    for pair in doc["pairs"]:
        parts = []
        for task in ("all tasks", "passkey"):
            c = pair["long_context"][task]["4096"]
            parts.append(
                f"{task} (n {c['samples']}) {100 * c['diff']:+.0f} points "
                f"[{100 * c['diff_low']:+.0f}, {100 * c['diff_high']:+.0f}], McNemar p "
                f"{c['mcnemar_p']:.2g}"
            )
        lines.append(f"{pair['recipe']} against {pair['reference']}, paired: {'; '.join(parts)}.")
    evals = _load(BENCH / "kvcalib-1.5-ablation" / "slots" / "eval_python_docs_qwen2.5-0.5b.json")
    setup = evals[0]["setup"]
    kl = ", ".join(
        f"{r['recipe']} {r['kld']:.3f} at {r['bits_per_element']:.2f} bits" for r in evals
    )
    lines.append(
        f"Prose KL against full precision ({setup['data']}, {setup['windows']} × "
        f"{setup['seq_len']:,} tokens, {setup['mode']}, residual {setup['residual']}; bits a "
        f"stored element of the quantized body): {kl}."
    )
    return render_lc("qwen2.5-0.5b", "long_context_vq") + "\n\n" + " ".join(lines)


def render_prompts() -> str:
    """The default calibration's 8 retrieval prompts against 16: kvcalib-2 on Qwen2.5's 4K suite
    paired (long_context_probe8.json's "against" rows, all tasks pooled) and its prose KL."""
    doc = lc_report("qwen2.5-0.5b", "long_context_probe8")
    (row,) = [r for r in doc["against"]["rows"] if r["recipe"] == "kvcalib-2-probe8"]
    c = row["long_context"]["all tasks"]["4096"]
    n = c["samples"]
    eight = round(c["accuracy"] * n)
    sixteen = eight - round(c["diff"] * n)
    kl = []
    for text, label in (("python-docs", "Python docs"), ("licenses", "licenses"), ("chat", "chat")):
        a, b = (_load(COST / "prompts-kl" / f"qwen2.5-0.5b-{text}-{k}-prompts.json")[0]["kld"]
                for k in (16, 8))  # fmt: skip
        kl.append(f"{label} {a:.4f} → {b:.4f}")
    return (
        f"On Qwen2.5-0.5B at 4K (n {n} prompts, paired), kvcalib-2 planned from 8 prompts answers "
        f"{eight} against {sixteen} from 16: {100 * c['diff']:+.1f} points "
        f"[{100 * c['diff_low']:+.1f}, {100 * c['diff_high']:+.1f}], McNemar p "
        f"{c['mcnemar_p']:.2f}; answer NLL {c['nll_diff']:+.3f} "
        f"[{c['nll_diff_low']:+.3f}, {c['nll_diff_high']:+.3f}] nats per token. Decode KL on "
        f"4 × 1,024 tokens of each text, 16 prompts → 8: {'; '.join(kl)}."
    )


def render_cost_model() -> str:
    """The cost model's prediction for the default calibration (--answer-probe screen), a
    sentence from PREDICTED."""
    doc = _load(PREDICTED)
    parts = []
    for r in doc["rows"]:
        if r["mode"] == "screen":
            p = r["phases"]
            parts.append(
                f"{sum(p.values()):.1f} on {r['model']} (the probe {p['answer probe']:.2f})"
            )
    return (
        f"{'; '.join(parts)}, with {doc['settings']['retrieval_prompts']} retrieval prompts of "
        f"{doc['settings']['retrieval_tokens']} tokens."
    )


def render_sessions(model: str = "qwen2.5-0.5b") -> str:
    """The session benchmark at its probe turns, a row per recipe, from sessions.json (written by
    benchmarks/session.py): fact recall, drift and repetition, each with its n and interval."""
    doc = _load(BENCH / "sessions" / model / "sessions.json")
    rows = []
    for name, r in doc["recipes"].items():
        turns = [c["turn"] for c in r["recall"]]
        kl = {c["turn"]: c for c in r["kl"]}
        rep = {c["turn"]: c for c in r["repeat4_diff"]}
        last = r["recall"][-1]
        recall = " / ".join(f"{100 * c['accuracy']:.0f}%" for c in r["recall"])
        if name == "fp16":
            diff = drift = repeat = "–"
        else:
            diff = (f"{100 * last['diff']:+.0f} [{100 * last['diff_low']:+.0f}, "
                    f"{100 * last['diff_high']:+.0f}], p {last['mcnemar_p']:.2g}")  # fmt: skip
            drift = " / ".join(f"{kl[t]['mean']:.3f}" for t in turns)
            c = rep[max(set(rep) - set(turns))]  # the last turn that asks no fact
            repeat = f"{100 * c['mean']:+.0f} [{100 * c['low']:+.0f}, {100 * c['high']:+.0f}]"
        rows.append([name, str(last["n"]), recall, diff, drift, repeat])
    t = " / ".join(str(c["turn"]) for c in next(iter(doc["recipes"].values()))["recall"])
    first = next(iter(doc["recipes"].values()))
    chat = max({c["turn"] for c in first["repeat4_diff"]} - {c["turn"] for c in first["recall"]})
    head = ["recipe", "sessions", f"fact recall at turns {t}", "Δ recall at the last vs fp16",
            f"drift KL at turns {t}", f"4-grams repeated vs fp16, turn {chat}"]  # fmt: skip
    table = _table(head, ["---", "---:", "---:", "---:", "---:", "---:"], rows)
    return doc["setup"] + ".\n\n" + table


def render_sessions_headline(model: str = "qwen2.5-0.5b") -> str:
    """The session benchmark in one sentence for the README: fact recall at the last probe turn
    and drift there, per recipe, with n (sessions.json)."""
    recipes = _load(BENCH / "sessions" / model / "sessions.json")["recipes"]
    first = next(iter(recipes.values()))
    turn, turns = first["recall"][-1]["turn"], len(first["kl"])

    def recall(r):
        c = r["recall"][-1]
        return f"{100 * c['accuracy']:.0f}% [{100 * c['low']:.0f}, {100 * c['high']:.0f}]"

    def drift(r):
        c = next(c for c in r["kl"] if c["turn"] == turn)
        return f"{c['mean']:.3f} [{c['low']:.3f}, {c['high']:.3f}]"

    recall = ", ".join(
        f"{name} {recall(r)} (n {r['recall'][-1]['n']})" for name, r in recipes.items()
    )

    def repeat(r):  # the last turn that asks no fact
        asks = {c["turn"] for c in r["recall"]}
        c = max((c for c in r["repeat4_diff"] if c["turn"] not in asks), key=lambda c: c["turn"])
        return f"{100 * c['mean']:+.0f} [{100 * c['low']:+.0f}, {100 * c['high']:+.0f}]"

    others = [(name, r) for name, r in recipes.items() if name != "fp16"]
    drift = ", ".join(f"{name} {drift(r)}" for name, r in others)
    chat = max({c["turn"] for c in first["repeat4_diff"]} - {c["turn"] for c in first["recall"]})
    repeated = ", ".join(f"{name} {repeat(r)}" for name, r in others)
    return (
        f"On Qwen2.5-Coder-0.5B, through chat sessions of {turns} turns whose answers stay in "
        f"the cache, the system prompt's facts asked at turn {turn} come back from {recall}; "
        f"drift there (KL per answer token against full precision on the same history): "
        f"{drift}; an answer's 4-grams that repeat earlier answers at turn {chat}, points "
        f"against fp16: {repeated}."
    )


# one decode step at 32K x 16 over 8 KV heads, against an H200's issue rate (budget_report's
# constants, as benchmarks/RESULTS.md's predictions read them)
STEP_ROWS = 32768 * 8 * 16
_, SMS, GHZ, _ = next(d for d in report.DEVICES if d[0] == "H200")
H200_ISSUE = SMS * report.SCHEDULERS * GHZ * 1e9  # warp-instructions a second
FLOOR_NAMES = {
    "triton": ("the loop's skeleton in Triton", "post-RoPE"),
    "gluon": ("the skeleton in Gluon", "post-RoPE"),
    "gluon+features": ("the Gluon skeleton with kvcalib-2's per-position work", "post-RoPE"),
    "gluon+features, pre-RoPE": ("the same, keys before RoPE", "pre-RoPE"),
    "gluon 4-bit": ("the Gluon skeleton at 4 bits (codebooks, tables of level pairs)", "post-RoPE"),
    "gluon 3-bit": ("the same at 3 bits (12 words a position, read by address)", "post-RoPE"),
}


WIDE_GLUON = ("kvcalib-3", "kvcalib-4", "kvcalib-1.5")  # Gluon tiles beside kvcalib-2's


def render_floor() -> str:
    """The decode kernel's whole-tile loop against its skeletons (kernel_budget/budget.json's
    kvcalib-2 rows at 32/8/128 on sm_90 as launched: the first kernel a step launches, the
    Gluon whole tiles where they apply, and kvcalib-3's, -4's and -1.5's Gluon tiles;
    kernel_budget/floor.json's rows), per position and the instruction floor of a 32K x 16
    step they imply on an H200."""
    budget = _load(BENCH / "kernel_budget" / "budget.json")
    floor = _load(BENCH / "kernel_budget" / "floor.json")
    names = {"_body_kernel": "the decode kernel's whole tiles, Gluon (kernels.decode_gluon)",
             "_decode_split_kernel": "the decode kernel, Triton"}  # fmt: skip
    rows = [(f"{r['recipe']}: {names[r['kernel']]} ({r['block_n']}, {r['num_warps']}, "
             f"{r['num_stages']})", r["keys"], r["registers"], r["per_position"])
            for r in budget["rows"]
            if r.get("chosen") and r["shape"] == "32/8/128" and r["arch"] == "sm_90"
            and not r["paged"] and (r["recipe"] == "kvcalib-2" or (r["recipe"] in WIDE_GLUON
                                    and r["kernel"] == "_body_kernel"))]  # fmt: skip
    rows += [(*FLOOR_NAMES[r["formulation"]][:1], FLOOR_NAMES[r["formulation"]][1],
              r["registers"], r["per_position"]) for r in floor["rows"]]  # fmt: skip
    lines = [
        "kvcalib-2 (and kvcalib-3's, -4's and -1.5's Gluon tiles; the skeletons' last rows: 4- and "
        f"3-bit codebooks) at 32/8/128, sm_90, compiled on a CPU (Triton {floor['triton']}); "
        f"the instruction floor is per position x {STEP_ROWS / 1e6:.2f} M rows / an H200's "
        f"issue rate ({H200_ISSUE:.3g} warp-instructions a second). Issue 51's targets: "
        "kvcalib-2 30 a position after RoPE, 36 before, 128 registers; kvcalib-3, -4 and -1.5 "
        "1.5 times kvcalib-2's.",
        "",
        "| loop | keys | registers | warp-instructions a position | instruction floor, 32K x 16 |",
        "|---|---|---:|---:|---:|",
    ]
    for name, keys, regs, per in rows:
        step_us = per * STEP_ROWS / H200_ISSUE * 1e6
        lines.append(f"| {name} | {keys} | {regs} | {per:.1f} | {step_us:.0f} µs |")
    return "\n".join(lines)


BLOCKS = {
    "headline": render_headline,
    "sources": render_sources,
    "main": render_main,
    "text-pydoc": lambda: render_text("pydoc"),
    "text-licenses": lambda: render_text("licenses"),
    "text-chat": lambda: render_text("chat"),
    "decode-gemma": lambda: render_decode("gemma3-270m"),
    "decode-qwen": lambda: render_decode("qwen2.5-0.5b"),
    "lc-smollm2": lambda: render_lc("smollm2-135m", "long_context_4bit"),
    "lc-qwen-4k": lambda: render_lc("qwen2.5-0.5b"),
    "lc-qwen-long": lambda: render_lc("qwen2.5-0.5b-long"),
    "calibration-cost": render_cost,
    "probe-prompts": render_prompts,
    "lc-qwen-vq": render_vq,
    "cost-model": render_cost_model,
    "sessions": render_sessions,
    "sessions-smollm2": lambda: render_sessions("smollm2-135m"),
    "sessions-headline": render_sessions_headline,
    "kernel-floor": render_floor,
}
FILES = (
    "README.md",
    "docs/results.md",
    "docs/long-context.md",
    "docs/models.md",
    "docs/sessions.md",
    "docs/serving.md",
)


def rewrite(text: str, render=None) -> str:
    """`text` with every docs block replaced by its rendering (render: NAME -> str)."""
    render = render or (lambda name: BLOCKS[name]())
    out, pos = [], 0
    while (start := text.find("<!-- docs:", pos)) >= 0:
        name = text[start + len("<!-- docs:") : text.index(" -->", start)]
        if name not in BLOCKS:
            raise SystemExit(f"error: block {name!r} has no renderer; known: {', '.join(BLOCKS)}")
        opening = f"<!-- docs:{name} -->"
        closing = f"<!-- /docs:{name} -->"
        end = text.find(closing, start)
        if end < 0:
            raise SystemExit(f"error: block {name!r} has no closing {closing}")
        out += [text[pos:start], opening, "\n", render(name), "\n", closing]
        pos = end + len(closing)
    return "".join(out) + text[pos:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block differs")
    args = parser.parse_args(argv)
    stale = []
    for rel in FILES:
        path = ROOT / rel
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            stale.append(rel)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"stale tables in {', '.join(stale)}: run make docs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
