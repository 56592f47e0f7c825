"""The analysis's defaults and names that its flags show, apart from the modules that compute with them.

The admin CLI builds every command's parser at each start: read from :mod:`splitstream.analysis.statistics`,
:mod:`splitstream.analysis.bayes` or :mod:`splitstream.analysis.model`, these few values cost numpy, scipy and
pydantic's models in every command, the ones that analyse nothing included."""

from __future__ import annotations

from typing import Literal

#: Units in both arms together at which the confidence sequence is tightest (``--sequential-tuning``): 5,000,
#: GrowthBook's default for its ``sequentialTestingTuningParameter``, which counts units in total too.
DEFAULT_TUNING_UNITS = 5_000

#: GrowthBook's default "chance to win" threshold: at or above it an arm is better, at or below 1 - it worse.
DEFAULT_THRESHOLD = 0.95
Engine = Literal["frequentist", "bayes"]
ENGINES: tuple[Engine, ...] = ("frequentist", "bayes")

#: Fields a segment may be taken from (``--segment``): readable fields of a call entry.
SEGMENT_FIELDS = ("principal",)
