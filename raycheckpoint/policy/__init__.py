"""Policy: what to keep (:mod:`.retention`) and when to save (:mod:`.triggers`).

Pure decisions over plain data (catalog entries, step numbers, metrics): no storage, no
Ray.  The protocol applies retention after each commit; the training loop asks the
triggers at each step.
"""
