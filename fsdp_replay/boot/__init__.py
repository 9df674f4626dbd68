"""What a training process needs before the agent exists: the sitecustomize, the attach, PYTHONPATH.

This package sits above both the agent (record mode) and the replayer (replay mode): ``attach`` is
the one module that imports both. ``site/`` holds only ``sitecustomize.py``, because its folder goes
first on other people's PYTHONPATH and anything else in it would shadow their modules.
"""
