"""Writes the seeded synthetic reviews that examples/text_reviews_fasttext.toml trains on.

    python examples/text_reviews_data.py [PATH] [--rows N]   (default runs/text_reviews/reviews.jsonl, 6,000 rows)

Amazon-review-style JSON Lines (``summary``, ``reviewText``, ``overall`` 1-5 stars) from
:func:`dniasync.train.data.text.generate_reviews`, seed 0: 500 filler words and 16 sentiment
words, each review with 4 sentiment words of which ``overall - 1`` are positive. Convert it with
the command in the example's header; a real review file converts the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dniasync.train.data.text import generate_reviews


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", default="runs/text_reviews/reviews.jsonl")
    parser.add_argument("--rows", type=int, default=6000)
    args = parser.parse_args()
    path = Path(args.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    generate_reviews(path, args.rows, seed=0)
    print(f"{path}: {args.rows:,} reviews")


if __name__ == "__main__":
    main()
