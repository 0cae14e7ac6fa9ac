"""The evaluator types of `config.evals`: the module that builds each
(big_vision's `evaluators/`: one module per type) and its settings with
their defaults (README). Few-shot: big_vision's `configs/common_fewshot.py`
values; k-NN: DINO's (`eval_knn.py`, DINOv2's `dinov2/eval/knn.py`)."""

# type -> the module that builds it.
MODULES = {
    'classification': 'evaluators.classification',
    'fewshot': 'evaluators.fewshot',
    'knn': 'evaluators.knn',
}
# type -> its settings and their defaults.
SETTINGS = {
    'classification': dict(dataset='', split='', class_map='', labels='',
                           real_labels_file='', every_steps=0),
    'fewshot': dict(datasets={}, shots=(1, 5, 10, 25), l2_reg=2.0**10,
                    seed=0, num_seeds=1, every_steps=0),
    'knn': dict(datasets={}, k=20, temperature=0.07, every_steps=0),
}
