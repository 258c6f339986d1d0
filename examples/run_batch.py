"""Run one program over 100 inputs concurrently, with a progress bar.

run_batch first sends the program's constant prefix once so every request reuses its cache.
Run: python examples/run_batch.py
"""

import time

import braid


@braid.function
def classify(s, review):
    s += braid.system("Classify the sentiment of product reviews.")
    s += braid.user(f"Review: {review}\nIs it positive or negative?")
    s += braid.assistant(braid.select("label", ["positive", "negative"]))


ADJECTIVES = ["great", "terrible", "wonderful", "awful", "excellent", "disappointing", "fantastic", "poor", "lovely",
              "useless"]
THINGS = ["battery", "screen", "keyboard", "camera", "speaker", "charger", "case", "app", "price", "design"]


def main():
    reviews = [f"The {t} is {a}." for a in ADJECTIVES for t in THINGS]  # 100 inputs
    runtime = braid.Runtime(model_path="smollm2")
    try:
        start = time.perf_counter()
        results = classify.run_batch([{"review": r} for r in reviews], backend=runtime, progress_bar=True)
        elapsed = time.perf_counter() - start
        failed = [r for r in results if isinstance(r, Exception)]
        labels = [r["label"] for r in results if not isinstance(r, Exception)]
        print(f"{len(reviews)} reviews in {elapsed:.1f}s: {labels.count('positive')} positive, "
              f"{labels.count('negative')} negative, {len(failed)} failed")
        for review, state in list(zip(reviews, results))[:5]:
            print(f"  {review:<35} -> {state['label'] if not isinstance(state, Exception) else state}")
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
