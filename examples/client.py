"""Ask the served example a question with the openai SDK, and print what kvnotes reports.

Start the server first (README, "Serve it"), then, from the repository root:

    .venv/bin/python examples/client.py
    .venv/bin/python examples/client.py "Can I still change my delivery address?"
    .venv/bin/python examples/client.py --policies refunds,warranty "My tent's zip broke."

The prompt is the header and the policies (``examples/<name>.txt``, the texts the server
registered), then the customer's question: the front finds the registered texts in it and
splices their notes instead of prefilling them, in any order and any subset. The script prints
the answer, the prompt tokens vLLM did not compute, then ``usage.kvnotes`` (what was spliced,
what was recomputed and why) as one JSON line.

The server's address: ``--base-url`` or ``$KVNOTES_BASE_URL`` (default
http://127.0.0.1:8000/v1); its key, when it was started with one: ``--api-key`` or
``$KVNOTES_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
QUESTION = "My boots were delivered 45 days ago and I never wore them. Can I get my money back?"


def prompt(question: str, policies: list[str]) -> str:
    """The header and the policies exactly as the server registered them, then the question."""
    texts = [(HERE / f"{name}.txt").read_text(encoding="utf-8") for name in ("header", *policies)]
    return "".join(texts) + f"Customer: {question}\nAgent:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--policies", default="refunds,shipping",
                        help="comma-separated policy files of examples/, in prompt order "
                             "(default: refunds,shipping)")
    parser.add_argument("--base-url", default=os.environ.get("KVNOTES_BASE_URL",
                                                             "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("KVNOTES_API_KEY", "unused"))
    parser.add_argument("--model", help="served model name (default: the server's only model)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    r = client.completions.create(model=model, max_tokens=args.max_tokens, temperature=0,
                                  prompt=prompt(args.question, args.policies.split(",")))
    # the answer up to a next turn the model may go on to write (cut here rather than with
    # `stop`: a request vLLM stops on a stop string comes back without the connector's report)
    print("Agent:", r.choices[0].text.split("\nCustomer:")[0].strip())
    if r.usage is not None:
        details = r.usage.prompt_tokens_details
        reused = details.cached_tokens if details and details.cached_tokens else 0
        print(f"prompt tokens: {r.usage.prompt_tokens}, not computed: {reused} "
              "(spliced skills and vLLM's prefix cache)")
        print("usage.kvnotes:", json.dumps((r.usage.model_extra or {}).get("kvnotes")))


if __name__ == "__main__":
    main()
