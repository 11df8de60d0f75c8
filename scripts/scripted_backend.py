"""The scripted OpenAI-compatible backend (a stand-in for vLLM or SGLang); its logic is rollgym.testing.scripted_vllm.

Run: ``python scripts/scripted_backend.py --host 127.0.0.1 --port 0 --port-file PATH [--token-info] ...``
(the same as ``python -m rollgym.testing.scripted_vllm``; ``--help`` lists every option).
"""

import sys

from rollgym.testing.scripted_vllm import main

if __name__ == "__main__":
    sys.exit(main())
