"""Genotypes: plink2's ``--score`` as a served model (``bitserve genotypes score-model``).

:mod:`service.genotypes.plink_files` reads ``.bed``/``.bim``/``.fam``,
:mod:`service.genotypes.score_file` a plink2 score file, :mod:`service.genotypes.writer`
writes the ``[score]`` model folder (:mod:`service.models.score_model` serves it).
"""

from service.genotypes.writer import ScoreModelReport, write_score_model

__all__ = ["ScoreModelReport", "write_score_model"]
