"""Fork a prompt into parallel branches, then join their answers.

The shared prefix is sent once; every branch reuses its cached KV.  Run: python examples/parallel_branches.py
"""

import braid

ASPECTS = ["price", "battery life", "camera", "screen"]


@braid.function
def review(s, product):
    s += braid.system("You are a product reviewer. Be concise.")
    s += braid.user(f"We are reviewing the {product}.")
    s += braid.assistant("Understood.")
    forks = s.fork(len(ASPECTS))
    forks += lambda i: (braid.user(f"In one sentence, how is its {ASPECTS[i]}?")
                        + braid.assistant(braid.gen("aspect", max_tokens=40, stop="\n")))
    forks.join()
    notes = "\n".join(f"- {a}: {t}" for a, t in zip(ASPECTS, s["aspect"]))
    s += braid.user(f"Notes:\n{notes}\nGive a final verdict in one sentence.")
    s += braid.assistant(braid.gen("verdict", max_tokens=48))


def main():
    runtime = braid.Runtime(model_path="smollm2")
    try:
        state = review.run(product="Pixel 9 phone", backend=runtime, temperature=0)
        for aspect, text in zip(ASPECTS, state["aspect"]):
            print(f"{aspect:>12}: {text}")
        print("     verdict:", state["verdict"])
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
