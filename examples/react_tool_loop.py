"""A ReAct-style loop: the model picks an action with select, braid runs the tool, the result goes
back into the prompt, until the model chooses to finish.  Run: python examples/react_tool_loop.py
"""

import ast
import operator

import braid

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


FACTS = {"paris": "Paris has about 2.1 million inhabitants.", "rome": "Rome has about 2.8 million inhabitants."}


def lookup(topic: str) -> str:
    return FACTS.get(topic.strip().lower(), "no entry")


TOOLS = {"calculator": calculator, "lookup": lookup}


@braid.function
def react(s, question, max_steps=4):
    s += braid.system("Solve the task step by step. Tools: calculator (arithmetic), lookup (facts about a city). "
                      "Choose finish when you know the answer.")
    s += braid.user(question)
    for step in range(max_steps):
        s += braid.assistant("Thought: " + braid.gen(f"thought_{step}", max_tokens=40, stop="\n"))
        s += braid.user("Which action now?")
        s += braid.assistant(braid.select(f"action_{step}", ["calculator", "lookup", "finish"]))
        action = s[f"action_{step}"]
        if action == "finish":
            break
        s += braid.user("Input for the tool?")
        s += braid.assistant(braid.gen(f"input_{step}", max_tokens=24, stop="\n",
                                       regex=r"[0-9+\-*/. ()]+" if action == "calculator" else r"[A-Za-z ]+"))
        observation = TOOLS[action](s[f"input_{step}"])
        s += braid.user(f"Observation: {observation}")
    s += braid.user("Final answer, briefly:")
    s += braid.assistant(braid.gen("answer", max_tokens=32))


def main():
    runtime = braid.Runtime(model_path="smollm2")
    try:
        state = react.run(question="How many people live in Paris and Rome together?", backend=runtime, temperature=0)
        for m in state.messages():
            print(f"[{m['role']}] {m['content']}")
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
