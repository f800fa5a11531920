// Names of a job's shared-memory segments and their clean-up. Only names of the given job are ever touched:
// "mapp_<job>_r<rank>" (published) and "mapp_<job>_r<rank>.init<pid>" (being built).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace mapp {

// Throws std::invalid_argument unless job_id is 1-64 characters from [A-Za-z0-9_-].
void validate_job_id(const std::string& job_id);
std::string segment_name(const std::string& job_id, int rank);

// Removes segments of `job_id` whose owner process is gone; returns the removed names.
std::vector<std::string> remove_dead_job_segments(const std::string& job_id);

// Makes `rank`'s name free for a new owner: removes a stale segment left by a dead process.
// Throws std::runtime_error if a live process still owns it.
void reclaim_segment_name(const std::string& job_id, int rank);

}  // namespace mapp
