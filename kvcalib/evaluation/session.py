"""`kvcalib eval --session`: a long chat session through every recipe's cache — the failure the
seeds describe (a support model with a ~2,000-token system prompt, dozens of user turns, the
cache at 2 bits: late replies drift off topic, repeat themselves, forget the system prompt).

A session (`generate`, seeded) is an operator's policy text of about SYSTEM_TOKENS tokens holding
a handful of facts (`FACTS`: an account number, a deadline, a product code, a refund limit), then
user turns of a few dozen to a few hundred tokens cut from the evaluation split of the built-in
text (`kvcalib.core.data`: text the calibration never saw); every PROBE_EVERY-th turn asks for
one of the facts instead. The model's chat template frames it.

Each recipe runs the whole session itself (`run_session`). Turn 1 (system prompt and first user
turn) is prefilled once in full precision and filled into its cache, which stores what a
prefill through it stores (`QuantizedKVCache.fill`, as the long-context suite does); every later
turn is prefilled as one chunk INTO the cache (attending to the history as the cache stores it:
quantized body, sinks, exact residual window; the chunk to itself exact). Each turn is answered
greedily (up to `max_new` tokens, or the end of turn), and the answer stays in the cache as a
real session keeps it. Beside it, a
full-precision cache (transformers' DynamicCache) is teacher-forced through the same tokens —
the recipe's own history — so every answer token is also scored by full precision given the same
history. Per turn the record holds:

    kl, kl_tokens     drift: the mean per-token KL(full precision || recipe) of the next-token
                      distributions over the answer's steps (and the end of turn, where the
                      recipe stopped there)
    first_agree       whether full precision, given the recipe's history, starts the answer with
                      the recipe's first token; agree: the share of all answer steps that agree
    repeat3, repeat4  repetition: the share of the answer's 3- and 4-grams found in the session's
                      earlier answers (None: an answer shorter than n tokens)
    sink_mass, system_mass, key_error and fp_sink_mass, fp_system_mass
                      at the answer's first step, attention on token 0 and on the system prompt,
                      averaged over heads and layers, through the recipe's cache and through full
                      precision on the same history; the system prompt keys' relative error over
                      the rest's median (`longprobe.Probe`)
    fact, correct, fact_nll  (probe turns) the asked fact, whether the greedy answer holds it,
                      and its value's teacher-forced NLL per token as the answer, through the
                      recipe's cache (scored tentatively: the greedy answer is what is kept)

Scores are paired against the fp16 recipe's session of the same seed by `sessionreport`.
"""

import random
import re
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvcalib.core import data as data_mod
from kvcalib.errors import OptionError, RecipeError
from kvcalib.evaluation.longcontext import Prefill, sinks_read, stop_tokens
from kvcalib.evaluation.longprobe import Probe
from kvcalib.sim.cache import QuantizedKVCache

SYSTEM_TOKENS = 1500
TURNS = 21
PROBE_EVERY = 7
USER_TOKENS = (30, 150)
MAX_NEW = 48
MARK = "\x00ANSWER{}\x00"

# (name, what the question calls it, how the answer is asked for)
FACTS = (
    ("account", "the operator's support account number", "the account number"),
    ("deadline", "the last day a refund request can be filed this season", "the date"),
    ("product", "the product code of the Premium plan", "the product code"),
    ("refund", "the largest refund an agent may approve without escalation", "the amount"),
)
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")  # fmt: skip
COMPANIES = ("Northwind Telecom", "Bluepeak Software", "Harbor Utilities", "Cobalt Insurance")
RULES = (
    "Greet the customer by name when the name is known, and never ask for it twice.",
    "Do not promise delivery dates that the order system does not show.",
    "If a customer reports a billing error, confirm the invoice number before anything else.",
    "Escalate to a supervisor when a customer mentions legal action, and say that you have.",
    "Never share another customer's data, even when the caller claims to be a relative.",
    "Explain fees in plain words, and state the total before taxes and after taxes.",
    "When a product is out of stock, offer the nearest equivalent and the restock estimate.",
    "Keep replies short: three sentences unless the customer asks for detail.",
    "Use the customer's language where it is one of the supported ones, else English.",
    "Do not speculate about outages; quote the status page and its last update time.",
    "A password reset goes through the verified email address only, never through chat.",
    "Record every complaint in the ticket system with its category and severity.",
    "Offer a callback when the wait for a specialist is longer than twenty minutes.",
    "Discounts above the standard loyalty rate need a supervisor's written approval.",
    "Do not quote internal tools, ticket queues or colleagues' names to customers.",
    "If the customer is a business account, check the contract tier before answering.",
    "Shipping to a new address requires the account holder to confirm by email.",
    "Warranty claims need the serial number and the purchase date; ask for both at once.",
    "Close a conversation only after asking whether anything else is needed.",
    "Apologize once for a mistake of ours, then focus on the fix.",
    "Never guess a technical answer: say you will check, and follow up in the ticket.",
    "Cancellation requests are honoured at the end of the current billing period.",
    "For accessibility requests, offer the large-print and screen-reader formats.",
    "Security questions are asked in the order the verification script gives.",
)
SECTIONS = ("Conduct", "Billing", "Orders and shipping", "Accounts and security", "Escalation",
            "Refunds and returns", "Technical support", "Closing a conversation")  # fmt: skip
FRAMES = (
    "I'm reading this part of the documentation for our integration. Can you explain it?",
    "A colleague sent me this and I don't follow it. What does it mean for us?",
    "Here is the next section I'm stuck on. Summarize it in a few sentences, please.",
    "Can you tell me what this says, in plain words?",
)


@dataclass
class Session:
    """A generated session: the system prompt, the facts in it ({name: value}), the user
    turns' texts, and which turns ask for which fact ({turn index: fact name})."""

    seed: int
    system: str
    facts: dict[str, str]
    users: list[str]
    probes: dict[int, str] = field(default_factory=dict)


def _values(rng: random.Random) -> dict[str, str]:
    return {
        "account": "-".join(f"{rng.randrange(1000, 10000)}" for _ in range(3)),
        "deadline": f"{rng.choice(MONTHS)} {rng.randrange(2, 29)}",
        "product": f"{rng.choice('BCDFGHKMQRTX')}{rng.choice('AEKLPVXZ')}-"
        f"{rng.randrange(1000, 10000)}",
        "refund": f"${rng.randrange(12, 90) * 5}",
    }


def _fact_sentence(name: str, value: str) -> str:
    what = {f[0]: f[1] for f in FACTS}[name]
    return f"For the record, {what} is {value}."


def _system(tokenizer, rng: random.Random, values: dict, target: int) -> str:
    """A policy text of about `target` tokens: sections of rules, the facts among them."""
    company = rng.choice(COMPANIES)
    head = (
        f"You are the customer support assistant of {company}. Follow this policy in every "
        "reply. Answer the customer's questions helpfully and stay on the topic they raise."
    )
    facts = [_fact_sentence(n, v) for n, v in values.items()]
    parts, size = [head], len(data_mod.encode(tokenizer, head))
    sections = list(SECTIONS)
    rng.shuffle(sections)
    while size < target:
        section = sections[len(parts) % len(sections)]
        rules = rng.sample(RULES, 4)
        if facts and rng.random() < 0.5:
            rules.insert(rng.randrange(len(rules) + 1), facts.pop())
        text = f"## {section}\n" + "\n".join(f"- {r}" for r in rules)
        parts.append(text)
        size += len(data_mod.encode(tokenizer, text))
    if facts:
        parts.append("## Reference\n" + "\n".join(f"- {f}" for f in facts))
    return "\n\n".join(parts)


def _excerpt(rng: random.Random, text: str, tokens: int) -> str:
    """About `tokens` tokens (four characters each) of `text` from a random paragraph on, cut
    at a space."""
    starts = [m.end() for m in re.finditer(r"\n\n", text)]
    start = rng.choice(starts[: max(1, len(starts) - 50)])
    piece = text[start : start + 4 * tokens]
    return piece.rsplit(" ", 1)[0].strip() if " " in piece else piece.strip()


def generate(
    tokenizer,
    seed: int,
    *,
    turns: int = TURNS,
    probe_every: int = PROBE_EVERY,
    system_tokens: int = SYSTEM_TOKENS,
    user_tokens: tuple[int, int] = USER_TOKENS,
    text: str | None = None,
) -> Session:
    """Session `seed`: its facts, system prompt and `turns` user turns, every `probe_every`-th
    (turn probe_every, 2 probe_every, ...; counted from 1) asking for a fact, the facts in
    turn."""
    if turns < 1 or probe_every < 1:
        raise OptionError(f"--session-turns {turns}: use at least one turn")
    rng = random.Random(seed)
    values = _values(rng)
    text = text if text is not None else data_mod.read_text(None, "evaluation")
    system = _system(tokenizer, rng, values, system_tokens)
    names = [f[0] for f in FACTS]
    rng.shuffle(names)
    users, probes = [], {}
    for t in range(turns):
        if (t + 1) % probe_every == 0:
            name = names[len(probes) % len(names)]
            _, what, noun = next(f for f in FACTS if f[0] == name)
            probes[t] = name
            users.append(f"Quick check before we go on: what is {what}? Reply with {noun} only.")
        else:
            body = _excerpt(rng, text, rng.randrange(*user_tokens))
            users.append(f"{rng.choice(FRAMES)}\n\n{body}")
    return Session(seed, system, values, users, probes)


def pieces(tokenizer, session: Session, answers: int) -> list[int]:
    """The tokens of turn `answers` (0-based) before its answer: the end of the previous answer's
    turn, the user turn, and the assistant's header — in the model's chat template (plain
    "User:/Assistant:" text without one). Each answer's own tokens are the model's."""
    msgs = [{"role": "system", "content": session.system}]
    for t in range(answers + 1):
        msgs.append({"role": "user", "content": session.users[t]})
        if t < answers:
            msgs.append({"role": "assistant", "content": MARK.format(t)})
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        bos = []
    else:
        said = {"user": "User: {}\nAssistant: ", "assistant": "{}\n"}
        text = session.system + "\n\n"
        text += "".join(said[m["role"]].format(m["content"]) for m in msgs[1:])
        bos = data_mod.bos_prefix(tokenizer)
    tail = text.split(MARK.format(answers - 1))[-1] if answers else text
    return (bos if not answers else []) + data_mod.encode(tokenizer, tail)


def system_tokens(tokenizer, session: Session) -> int:
    """How many of the session's first tokens are the system turn (its template included): the
    span whose attention the probe measures."""
    first = pieces(tokenizer, session, 0)
    text = tokenizer.decode(first)
    return len(first) - len(data_mod.encode(tokenizer, text[text.index(session.users[0]) :]))


def _ngrams(ids: list[int], n: int) -> list[tuple]:
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def repetition(answer: list[int], earlier: list[list[int]], n: int) -> float | None:
    """The share of `answer`'s n-grams that occur in an earlier answer (None: fewer than n
    tokens)."""
    grams = _ngrams(answer, n)
    if not grams:
        return None
    seen = {g for a in earlier for g in _ngrams(a, n)}
    return sum(g in seen for g in grams) / len(grams)


def _normal(s: str) -> str:
    return re.sub(r"[^0-9a-z]", "", s.lower())


def _cache(model, candidate, max_len: int) -> QuantizedKVCache:
    if candidate.scheme is None:
        raise RecipeError(
            f"recipe {candidate.name} runs {candidate.recipe.external}'s own cache, which the "
            "session benchmark cannot score tentatively: leave it out of --session"
        )
    return QuantizedKVCache(
        model, candidate.scheme, candidate.params, candidate.transforms, max_len=max_len
    )


def _forward(model, cache, ids: list[int], probe=None, *, last: bool = False) -> torch.Tensor:
    """Logits [T, V] of `ids` through `cache` (kept; `last`: of the last token only, [1, V]),
    `probe` recording the forward's first query."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    keep = 1 if last else 0
    with probe if probe is not None else _null():
        return model(x, cache=cache, use_cache=True, logits_to_keep=keep).logits[0].float()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _decode(model, cache, logits, max_new: int, stop: set[int], probe) -> tuple[list, list]:
    """Greedy tokens through `cache` after next-token `logits`, kept in it, and the log-softmax
    of every step taken (the one that chose the end of turn included); `probe` records the
    first decode step."""
    tokens, steps = [], [logits.log_softmax(-1)]
    while len(tokens) < max_new:
        token = int(steps[-1].argmax())
        if token in stop:
            break
        tokens.append(token)
        logits = _forward(model, cache, [token], probe if len(tokens) == 1 else None)[-1]
        if len(tokens) < max_new:
            steps.append(logits.log_softmax(-1))
    return tokens, steps


def _kl(fp: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Per step KL(fp || mine) of log-probabilities [S, V]."""
    return (fp.exp() * (fp - mine)).sum(-1)


def _probe_record(probe: Probe) -> dict:
    """The probe's signals; None each where no step ran (an answer that ended at once)."""
    if not probe.layers:
        return {"sink_mass": None, "system_mass": None, "key_error": None}
    rec = probe.record()
    return {
        "sink_mass": rec["sink_mass"],
        "system_mass": rec["needle_mass"],
        "key_error": rec["needle_key_error"],
    }


def run_session(model, tokenizer, candidate, session: Session, *, max_new: int = MAX_NEW):
    """The session through `candidate`'s cache, every turn also teacher-forced through a
    full-precision cache: {"turns": [per-turn record, see the module docstring], "seconds"}."""
    start = time.perf_counter()
    stop = stop_tokens(tokenizer)
    turns = [pieces(tokenizer, session, t) for t in range(len(session.users))]
    end = turns[1][0] if len(turns) > 1 else None  # the end-of-turn token the template writes
    if end is not None and end in set(getattr(tokenizer, "all_special_ids", ())):
        stop = stop | {end}
    span = [(0, system_tokens(tokenizer, session))]
    max_len = sum(map(len, turns)) + len(turns) * (max_new + 1) + 64
    device = next(model.parameters()).device
    prefill = Prefill(model, torch.tensor([turns[0]], device=device), sinks_read([candidate]))
    fp = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
        fp.update(k, v, i)
    records, answers = [], []
    with _cache(model, candidate, max_len) as cache:
        cache.fill(prefill.keys_pre, prefill.values, prefill.hidden)
        for t, ids in enumerate(turns):
            if t == 0:
                mine, before = prefill.logits.float(), prefill.logits.float().log_softmax(-1)
            else:
                mine = _forward(model, cache, ids, last=True)[-1]
                before = _forward(model, fp, ids, last=True)[-1].log_softmax(-1)
            rec = {"turn": t + 1, "prompt_tokens": len(ids)}
            if t in session.probes:
                rec.update(_fact(model, tokenizer, cache, mine, session, session.probes[t]))
            keys = [layer.keys for layer in fp.layers]
            probe = Probe(model, keys, span, (0, fp.get_seq_length()))
            answer, steps = _decode(model, cache, mine, max_new, stop, probe)
            rec.update(_probe_record(probe))
            fp_steps = [before]
            if answer:
                fp_probe = Probe(model, [layer.keys for layer in fp.layers], span, (0, 1))
                after = _forward(model, fp, answer, fp_probe).log_softmax(-1)
                fp_steps += list(after[: len(steps) - 1])
                theirs = _probe_record(fp_probe)
                rec["fp_sink_mass"], rec["fp_system_mass"] = (
                    theirs["sink_mass"],
                    theirs["system_mass"],
                )
            ours, theirs = torch.stack(steps), torch.stack(fp_steps)
            kl = _kl(theirs, ours)
            chosen = theirs.argmax(-1) == ours.argmax(-1)
            rec.update(
                answer=answer,
                text=tokenizer.decode(answer),
                kl=float(kl.mean()),
                kl_tokens=len(kl),
                first_agree=bool(chosen[0]),
                agree=float(chosen.float().mean()),
                repeat3=repetition(answer, answers, 3),
                repeat4=repetition(answer, answers, 4),
            )
            if "correct" in rec:
                rec["correct"] = _normal(session.facts[rec["fact"]]) in _normal(rec["text"])
            answers.append(answer)
            records.append(rec)
    return {"turns": records, "seconds": time.perf_counter() - start}


def _fact(model, tokenizer, cache, logits, session: Session, name: str) -> dict:
    """The asked fact's value teacher-forced as the answer through `cache`, tentatively: its
    mean per-token NLL (the first token scored on the turn's `logits`)."""
    ids = data_mod.encode(tokenizer, session.facts[name])
    with cache.tentative():
        rest = _forward(model, cache, ids)[:-1] if len(ids) > 1 else logits[:0]
    logp = torch.cat([logits[None], rest]).log_softmax(-1)
    nll = -logp[torch.arange(len(ids)), torch.tensor(ids)].mean()
    return {"fact": name, "correct": None, "fact_nll": float(nll)}
