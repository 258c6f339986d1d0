"""A multi-turn chat, streaming the last answer as it is generated.  Run: python examples/multi_turn_chat.py"""

import braid


@braid.function
def chat(s, questions):
    s += braid.system("You are a helpful assistant. Keep answers short.")
    for i, question in enumerate(questions):
        s += braid.user(question)
        s += braid.assistant(braid.gen(f"answer_{i}", max_tokens=64))


def main():
    runtime = braid.Runtime(model_path="smollm2")
    try:
        questions = ["What is the tallest mountain on Earth?", "How high is it?", "Who first climbed it?"]
        state = chat.run(questions=questions, backend=runtime, temperature=0, stream=True)
        for i, question in enumerate(questions):
            print(f"user: {question}\nassistant: ", end="", flush=True)
            for piece in state.text_iter(f"answer_{i}"):
                print(piece, end="", flush=True)
            print()
        print(f"\n{len(state.messages())} messages")
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
