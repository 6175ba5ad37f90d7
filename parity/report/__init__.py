"""The report: the result records and their console, JSON and Markdown renderings.

  records  `Record` (one case x check x leg x path) and the status names.
  report   console summary (with skip reasons), ``parity.json`` (strict JSON; inf/nan as
           strings) and ``parity.md``, both written atomically.
"""
