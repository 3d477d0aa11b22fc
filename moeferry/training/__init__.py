"""Training of the built-in model (`python -m moeferry.training corpus|tokenizer|train|export`).

Not used at serving time: it is the seeded recipe that produced the weights committed in
moeferry/builtin_model/, kept so anyone can reproduce or change them. See that folder's
README.md (the model card) for the data, the sizes and the measured perplexity.
"""
