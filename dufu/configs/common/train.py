# The `train` namespace: every run-level setting, with LiBai's names and defaults. Its schema,
# dufu.engine.schema.Train, holds each key's type, default and meaning; a recipe edits this node
# (`train.train_iter = 10_000`) and a key the schema lacks is refused unless added on purpose
# (`train.add(my_key=...)`).
from dufu.config import schema_node
from dufu.engine.schema import Train

train = schema_node(Train)
