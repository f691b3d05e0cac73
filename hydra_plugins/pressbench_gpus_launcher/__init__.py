"""PressBench's Hydra plugins: the ``gpus`` launcher (one worker per visible GPU) and the ``grids`` sweeper.

Hydra finds them by importing every module under the ``hydra_plugins`` namespace package, which has no
``__init__.py`` so that it merges with the ``hydra_plugins`` of installed plugins (hydra-submitit-launcher).
"""
