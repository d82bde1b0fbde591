"""Chat with a ~31K-token book whose answer sits in its first tenth (issue 11's 30K check).

Builds the book from Python's own documentation (`pydoc_data.topics`) with one inserted fact at 5% of
its length, then drives `sekv-local chat --no-tui` through stdin, so the progress bar and answers are
what a user sees. Usage:

    python scripts/long_chat_check.py --model gemma3-270m --method sekv --budget 0.25 --out runs/long_chat
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pydoc_data.topics import topics

FACT = "The harbour master of Port Elwin keeps the spare lighthouse key in locker number 4817."
QUESTIONS = (
    "Which locker holds the spare lighthouse key of Port Elwin?",
    "In which locker number does the harbour master of Port Elwin keep the spare lighthouse key?",
)
ANSWER = "4817"


def build_book(n_chars: int = 130_000, fact_at: float = 0.05) -> str:
    """Documentation prose (about 31K Gemma 3 tokens for the default size) with FACT at a paragraph
    break near `fact_at` of its length."""
    body = "\n\n".join(topics[k] for k in sorted(topics))[:n_chars]
    cut = body.rfind("\n\n", 0, int(len(body) * fact_at))
    return f"{body[:cut]}\n\n{FACT}\n\n{body[cut:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--method", default="sekv")
    parser.add_argument("--budget", default="0.25")
    parser.add_argument("--threads", default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/long_chat"))
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    book = args.out / "book.txt"
    book.write_text(build_book())
    command = [sys.executable, "-m", "sekv_local", "chat", str(book), "-m", args.model, "--method", args.method,
               "--no-tui"]
    if args.method != "full":
        command += ["--budget", args.budget]
    if args.threads:
        command += ["--threads", str(args.threads)]
    # each question on a fresh conversation, so no answer leans on an earlier one
    stdin = "".join(f"{q}\n/reset\n" for q in QUESTIONS) + "/quit\n"
    done = subprocess.run(command, input=stdin, text=True, stdout=subprocess.PIPE)
    print(done.stdout)
    answers = [line for line in done.stdout.splitlines() if line.strip() and not line.startswith(("(", ">"))]
    (args.out / "transcript.txt").write_text(done.stdout)
    print(f"questions answered with {ANSWER}: {sum(ANSWER in a for a in answers)}/{len(QUESTIONS)}")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
