"""`kvmap validate`: find every inconsistency in a trace (driver.py), with an independent shadow model
(shadow.py), problem kinds (problems.py) and the differential check against the reference (deep.py)."""

from kvmap.validate.driver import validate
from kvmap.validate.problems import KINDS, Problem, ValidationReport

__all__ = ["KINDS", "Problem", "ValidationReport", "validate"]
