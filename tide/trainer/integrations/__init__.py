"""Tide for the trainers users already have (docs/migrate.md).

- ``tide.trainer.integrations.paddle_launch``: the ``python -m paddle.distributed.launch`` command
  line, translated to ``python -m tide.trainer.launch``'s (no Paddle import: the launcher uses it);
- ``tide.trainer.integrations.paddleformers``: PaddleFormers' ``Trainer`` under an
  ``ElasticSession`` (imports Paddle and PaddleFormers: the ``paddleformers`` extra).
"""
