"""Protocol: the save protocol and the on-disk format, never a tensor.

* :mod:`.paths` and :mod:`.format`: every name and path of a root, and the metadata
  schemas (manifest, marker, version);
* :mod:`.catalog`: what a root holds (markers, LATEST, tags, the catalog cache), and
  the writes that keep those caches;
* :mod:`.refs`: a reference (path, step, tag, ``latest``, ``auto``) resolved;
* :mod:`.checkpoint`: a committed checkpoint opened, its metadata verified;
* :mod:`.lease`: one job per root;
* :mod:`.root`: the coordinator's state of its root;
* :mod:`.commit`: the commit sequence (DESIGN section 2.4) as one function;
* :mod:`.collect`: recovery, garbage collection and retention;
* :mod:`.coordinator`: the Ray actor that runs begin, the barrier and the commit.

This package imports none of its modules.
"""
