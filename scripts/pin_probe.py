"""Which spans a question pins, per layer, and where the span holding the answer ranks (select=question).

Reads FILE with the torch engine and SeKV, asks QUESTION, and prints per layer the pinned spans and the rank of
the span holding the first occurrence of ANSWER (0 = the most question mass). A development probe: it says
where the pins go, not how often answers are right.

    python scripts/pin_probe.py sekv_local/data/sample.md "Who is the keeper of the lighthouse?" \\
        "The keeper of the lighthouse is Maren Holt." --option pin_spread=0.5
"""

from __future__ import annotations

import argparse

from sekv_local.method_variant import split_variant
from sekv_local.sekv.policy import SekvCache
from sekv_local.session import Session, SessionSettings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("question")
    ap.add_argument("answer", help="text of the document that answers the question")
    ap.add_argument("--option", action="append", default=[], help="SeKV option KEY=VALUE (repeatable)")
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    _, options = split_variant("sekv" + "".join(f"@{o}" for o in args.option))
    settings = SessionSettings(engine="torch", method="sekv", budget=args.budget, threads=args.threads,
                               max_new_tokens=24, method_options=tuple(sorted(options.items())))
    session = Session.create(args.file, settings, show_progress=False)
    session.ingest()
    cache = session.engine.cache
    text = session.document.text
    prefix, _ = session.prompt.document_tokens(text)
    answer_token = len(prefix) + len(session.tokenizer.encode(text[: text.index(args.answer)]))
    starts, lengths = cache.span_pos.view(), cache.span_len.view()
    holding = ((starts <= answer_token) & (answer_token < starts + lengths)).nonzero().flatten().tolist()
    if not holding:
        raise SystemExit(f"the answer's first token ({answer_token}) is not in a span (exact rows hold it)")
    target = holding[0]
    seen: dict = {}
    pin_question = SekvCache._pin_question

    def recording(self: SekvCache) -> None:
        seen["mass"] = [None if m is None else m.clone() for m in self._question_mass]
        seen["rows"] = self._pin_room()
        pin_question(self)

    SekvCache._pin_question = recording
    answer = session.answer(args.question)
    n = cache.span_len.length
    pins = [[] if p is None else p.mask_for(n).nonzero().flatten().tolist() for p in cache._pins]
    print(f"{n} spans; the answer's span {target} (tokens {int(starts[target])}+{int(lengths[target])}); "
          f"pin room {seen['rows']} rows; routed slots per step {cache.step_slots}")
    print(f"answer: {answer.text!r}")
    for layer, (mass, pinned) in enumerate(zip(seen["mass"], pins)):
        rank = "-" if mass is None else int((mass > mass[target]).sum())
        print(f"layer {layer:2d}: rank {rank:>3}  {'PINNED' if target in pinned else '      '}  pins {pinned}")
    print(f"pinned in {sum(target in p for p in pins)} of {len(pins)} layers")


if __name__ == "__main__":
    main()
