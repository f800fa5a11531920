// Who may talk to a rank's listener: a process that knows the job's secret. The secret is drawn by rank 0 at
// start-up and shared through the job's store (the ranks trust it already); it never travels on these sockets.
// On every accepted connection the listener sends a fresh random challenge; the connector answers with
// HMAC-SHA256(secret, domain | job id | challenge) before its backend's hello. A wrong or missing answer is
// dropped and counted, never named as a peer; a replayed answer fails because every challenge is new.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mapp {

constexpr uint32_t kAdmissionMagic = 0x4E44414Du;  // "MADN"
constexpr uint32_t kAdmissionVersion = 1;
constexpr size_t kAdmissionNonceBytes = 32;
constexpr size_t kAdmissionMacBytes = 32;

struct AdmissionChallenge {
  uint32_t magic;
  uint32_t version;
  uint8_t nonce[kAdmissionNonceBytes];
};

struct AdmissionProof {
  uint32_t magic;
  uint32_t version;
  uint8_t mac[kAdmissionMacBytes];
};

using Sha256Digest = std::array<uint8_t, 32>;
Sha256Digest sha256(const uint8_t* data, size_t size);
Sha256Digest hmac_sha256(const std::string& key, const uint8_t* data, size_t size);

// A challenge with a nonce from the kernel's random source (getrandom). Throws std::runtime_error if it fails.
AdmissionChallenge make_admission_challenge();
// The connector's answer to `challenge` for job `job_id` keyed by `secret`.
AdmissionProof prove_admission(const AdmissionChallenge& challenge, const std::string& secret,
                               const std::string& job_id);
// "" when `proof` answers `challenge` (compared in constant time), else why not.
std::string check_admission(const AdmissionChallenge& challenge, const AdmissionProof& proof,
                            const std::string& secret, const std::string& job_id);
// "" when a challenge read off the wire is one this build answers, else why not.
std::string check_admission_challenge(const AdmissionChallenge& challenge);

// Connector side, on a freshly connected blocking socket: reads the listener's challenge (giving up after
// `timeout_s`) and writes the proof. Throws std::runtime_error saying what went wrong.
void answer_admission(int fd, const std::string& secret, const std::string& job_id, double timeout_s);

}  // namespace mapp
