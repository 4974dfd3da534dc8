"""Three agents on the plain `openai` client: a planner, a solver with a calculator tool, and
a reporter. Written as any program would be - nothing here knows about `car`:

    car record --outcome 'python examples/check.py' -- python examples/three_agents.py

The agents are told apart three ways, to show each: the planner sends an `X-Car-Agent`
header, the solver sets the OpenAI `user` field, the reporter only has its system prompt.
The calculator runs in this program (OpenAI tool calling: the model asks, the program
answers). The result goes to a file named by the run ($CAR_RUN_ID; or $THREE_AGENTS_OUT)
for check.py.

    --stream   the reporter streams its answer
"""

from __future__ import annotations

import json
import operator
import os
import sys
import tempfile

from openai import OpenAI

MODEL = os.environ.get("THREE_AGENTS_MODEL", "smollm2")
# one file per run: car sets CAR_RUN_ID for the program and its outcome command alike, so
# concurrent fork branches (-c N) never share one
OUT = os.environ.get("THREE_AGENTS_OUT") or os.path.join(
    tempfile.gettempdir(), f"three_agents-{os.environ.get('CAR_RUN_ID', 'run')}.json"
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute a op b for two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "op": {"type": "string", "enum": ["+", "-", "*"]},
                "b": {"type": "integer"},
            },
            "required": ["a", "op", "b"],
        },
    },
}
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def calculator(arguments: str) -> str:
    """The tool: a op b, or an error text the model gets back instead."""
    try:
        args = json.loads(arguments)
        a, b = int(args["a"]), int(args["b"])
        if abs(a) > 10**9 or abs(b) > 10**9:
            return "error: numbers too large"
        return str(OPS[args["op"]](a, b))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {type(e).__name__}"


def main() -> int:
    stream = "--stream" in sys.argv[1:]
    client = OpenAI(max_retries=0)
    task = "A crate holds 6 boxes of 7 apples each. How many apples are in the crate?"

    plan = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "system",
                "content": "You are the planner. Say in one sentence how to solve the task.",
            },
            {"role": "user", "content": task},
        ],
        max_tokens=32,
        temperature=0.8,
        extra_headers={"X-Car-Agent": "planner"},
    )
    plan_text = plan.choices[0].message.content or ""

    solver_msgs: list = [
        {"role": "system", "content": "You are the solver. Use the calculator."},
        {"role": "user", "content": f"Task: {task}\nPlan: {plan_text}"},
    ]
    asked = client.chat.completions.create(
        model=MODEL,
        messages=solver_msgs,
        tools=[CALCULATOR],
        tool_choice={"type": "function", "function": {"name": "calculator"}},
        max_tokens=40,
        temperature=0.8,
        user="solver",
    )
    msg = asked.choices[0].message
    result = "no tool call"
    # content "" rather than null: some servers' chat templates need a text in every message
    calls = [c.model_dump() for c in msg.tool_calls or []]
    solver_msgs.append({"role": "assistant", "content": msg.content or "", "tool_calls": calls})
    for call in msg.tool_calls or []:
        result = calculator(call.function.arguments)
        solver_msgs.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = client.chat.completions.create(
        model=MODEL, messages=solver_msgs, max_tokens=32, temperature=0.8, user="solver"
    )
    answer_text = answer.choices[0].message.content or ""

    report_req = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are the reporter. State the final number."},
            {"role": "user", "content": f"Task: {task}\nSolver: {answer_text}"},
        ],
        "max_tokens": 32,
        "temperature": 0.8,
    }
    if stream:
        parts = []
        for chunk in client.chat.completions.create(**report_req, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        report = "".join(parts)
    else:
        report = client.chat.completions.create(**report_req).choices[0].message.content or ""

    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(
            {"plan": plan_text, "tool_result": result, "answer": answer_text, "report": report}, f
        )
    print(f"report: {report[:100]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
