"""The benchmarks, run from the repository root as `python -m benchmarks.<name>` (not shipped in the wheel).

Importing the package sets the environment every benchmark runs with (`benchmarks.environment`) before a benchmark
module's own imports run.
"""

from benchmarks.environment import set_process_defaults

set_process_defaults()
