#pragma once

// The counters of one tree, defined once (an X-macro in the manner of ATen's AT_FORALL_*).

#include <cstdint>

namespace graphtrees {

// Note [Tree counters]
// Every counter a tree keeps is one row of this table: its name (the tree_info() key) and what it
// counts (documented from here: graphtrees._C.tree_counters, tree_info.__doc__, docs/api.md).
// TreeManager owns one TreeCounters and lends it to LiveOutputs and PoolBookkeeping; a snapshot
// copies it whole, and the bindings turn it into a dict in one loop.
#define GRAPHTREES_TREE_COUNTERS(_)                                                               \
  _(num_nodes, "recordings in the tree now")                                                      \
  _(num_checkpoints, "pool restores to a node's checkpoint (branch switches)")                    \
  _(num_rerecords, "recordings of a signature under a parent that held one already (re-records)") \
  _(num_fallbacks, "calls run eagerly (each reason is logged once)")                              \
  _(num_warmups, "warmup runs")                                                                   \
  _(num_recordings, "recordings made")                                                            \
  _(num_replays, "replays")                                                                       \
  _(num_program_replays, "CPU replays that ran the recorded op program (Note [CPU graphs])")      \
  _(num_invalidations, "live outputs invalidated because a later run reused their memory")        \
  _(num_evictions, "evictions of recordings (memory budget, max_recorded_shapes)")                \
  _(num_out_of_memory, "warmups and recordings that an allocation failure turned eager")          \
  _(bytes_released, "pool memory returned to the device after evictions and allocation failures") \
  _(num_migrations,                                                                               \
    "outputs copied out of the pool instead of invalidated (gradients, "                          \
    "on_overwrite='copy')")

struct TreeCounters {
#define GRAPHTREES_DECLARE_COUNTER(name, doc) int64_t name = 0;
  GRAPHTREES_TREE_COUNTERS(GRAPHTREES_DECLARE_COUNTER)
#undef GRAPHTREES_DECLARE_COUNTER
};

}  // namespace graphtrees
