"""Few-shot question answering.  Run: python examples/few_shot_qa.py"""

import braid


@braid.function
def few_shot_qa(s, question):
    s += braid.system("Answer each question with one word.")
    s += braid.user(
        "Q: What is the capital of France?\nA: Paris\n"
        "Q: What is the capital of Germany?\nA: Berlin\n"
        "Q: What is the capital of Japan?\nA: Tokyo\n"
        f"Q: {question}\nA:"
    )
    s += braid.assistant(braid.gen("answer", max_tokens=8, stop="\n"))


def main():
    runtime = braid.Runtime(model_path="smollm2")
    try:
        braid.set_default_backend(runtime)
        state = few_shot_qa.run(question="What is the capital of Italy?", temperature=0)
        print(state.text())
        print("answer:", state["answer"])
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
