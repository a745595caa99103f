"""Entry point of one worker process: ``python -m benchmarks.worker REQUEST_JSON OUT_JSON``.

The parent (:func:`benchmarks.runner.run_job`) starts one of these per job so that each
framework, and each contender that changes global state (``mxnet.contrib.amp.init``
monkey-patches ``mx.nd``), is timed in a process of its own. The request names a function
``"module:function"``; it is called as ``function(options, **kwargs)`` and must return a
:class:`~benchmarks.runner.JobResult`, which is written to OUT_JSON.
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings

from benchmarks.runner import JobResult, Options


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    module_name, function_name = request["function"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    options = Options.from_dict(request["options"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # library deprecation chatter is not a benchmark result
        result: JobResult = function(options, **request["kwargs"])
    with open(argv[1], "w") as fh:
        json.dump(result.to_dict(), fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
