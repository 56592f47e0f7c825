"""A/B verdicts: exposures from the call records joined with outcome feedback, analysed per unit."""
