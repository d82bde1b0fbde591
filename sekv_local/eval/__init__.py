"""Local evaluation: seeded RULER-style task generators (:mod:`.tasks`), RULER string-match
scoring (:mod:`.scoring`) and reports (:mod:`.report`). Nothing is downloaded."""
