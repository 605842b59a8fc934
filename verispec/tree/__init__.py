"""Draft trees, by subject:

  layout  parents -> the ancestor mask, depths and paths one verification pass needs (TreeLayout)
  shapes  what a drafter is asked to fill: StaticTree (paths of sibling ranks), DynamicTree (EAGLE-2),
          parse_tree, and the rank-acceptance model that picks the default static trees
  build   Candidate, the one tree builder (build_tree) every logits drafter calls with its own Scorer,
          select_best and to_proposal
  budget  the node budget from hardware (Sequoia): choose_budget, measure_verify_cost, RankAcceptance,
          StepCosts, and AutoBudget, the engine's auto budget over them (choose, observe)
"""

from verispec.tree.budget import AutoBudget, BudgetChoice, RankAcceptance, StepCosts, choose_budget, measure_verify_cost, tree_tokens
from verispec.tree.build import (Candidate, Scorer, ancestors, build_tree, children, sample_without_replacement,
                                 select_best, to_proposal)
from verispec.tree.layout import (TreeLayout, ancestor_mask, check_parents, children_lists, path_to,
                                  retrieve_indices, tree_depths)
from verispec.tree.shapes import (DEFAULT_RANK_ACCEPTANCE, MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_RANK,
                                  STATIC_TREES, DynamicTree, Path, StaticTree, TreeShape, expected_accepted,
                                  optimal_paths, parse_tree, sort_paths, validate_paths)

__all__ = ["AutoBudget", "BudgetChoice", "RankAcceptance", "StepCosts", "choose_budget", "measure_verify_cost", "tree_tokens",
           "Candidate", "Scorer", "ancestors", "build_tree", "children", "sample_without_replacement", "select_best",
           "to_proposal", "TreeLayout", "ancestor_mask", "check_parents", "children_lists", "path_to", "retrieve_indices",
           "tree_depths", "DEFAULT_RANK_ACCEPTANCE", "MAX_TREE_DEPTH", "MAX_TREE_NODES", "MAX_TREE_RANK",
           "STATIC_TREES", "DynamicTree", "Path", "StaticTree", "TreeShape", "expected_accepted", "optimal_paths",
           "parse_tree", "sort_paths", "validate_paths"]
