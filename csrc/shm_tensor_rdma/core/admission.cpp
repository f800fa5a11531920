#include "admission.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace mapp {
namespace {

constexpr char kDomain[] = "megatron_app admission v1";

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotate_right(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress(uint32_t state[8], const uint8_t block[64]) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = uint32_t{block[4 * i]} << 24 | uint32_t{block[4 * i + 1]} << 16 | uint32_t{block[4 * i + 2]} << 8 |
           uint32_t{block[4 * i + 3]};
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotate_right(w[i - 15], 7) ^ rotate_right(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotate_right(w[i - 2], 17) ^ rotate_right(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = state[0], b = state[1], c = state[2], d = state[3], e = state[4], f = state[5], g = state[6],
           h = state[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 = h + (rotate_right(e, 6) ^ rotate_right(e, 11) ^ rotate_right(e, 25)) +
                        ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    const uint32_t t2 = (rotate_right(a, 2) ^ rotate_right(a, 13) ^ rotate_right(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  state[0] += a; state[1] += b; state[2] += c; state[3] += d;
  state[4] += e; state[5] += f; state[6] += g; state[7] += h;
}

std::vector<uint8_t> signed_bytes(const AdmissionChallenge& challenge, const std::string& job_id) {
  std::vector<uint8_t> bytes(kDomain, kDomain + sizeof(kDomain));
  bytes.insert(bytes.end(), job_id.begin(), job_id.end());
  bytes.push_back(0);
  bytes.insert(bytes.end(), challenge.nonce, challenge.nonce + kAdmissionNonceBytes);
  return bytes;
}

}  // namespace

Sha256Digest sha256(const uint8_t* data, size_t size) {
  uint32_t state[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  size_t done = 0;
  for (; size - done >= 64; done += 64) compress(state, data + done);
  uint8_t tail[128] = {0};
  const size_t rest = size - done;
  if (rest) std::memcpy(tail, data + done, rest);
  tail[rest] = 0x80;
  const size_t tail_bytes = rest < 56 ? 64 : 128;
  const uint64_t bits = uint64_t{size} * 8;
  for (int i = 0; i < 8; ++i) tail[tail_bytes - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  compress(state, tail);
  if (tail_bytes == 128) compress(state, tail + 64);
  Sha256Digest digest;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) digest[4 * i + j] = static_cast<uint8_t>(state[i] >> (24 - 8 * j));
  }
  return digest;
}

Sha256Digest hmac_sha256(const std::string& key, const uint8_t* data, size_t size) {
  uint8_t block[64] = {0};
  if (key.size() > sizeof(block)) {
    const Sha256Digest hashed = sha256(reinterpret_cast<const uint8_t*>(key.data()), key.size());
    std::memcpy(block, hashed.data(), hashed.size());
  } else if (!key.empty()) {
    std::memcpy(block, key.data(), key.size());
  }
  std::vector<uint8_t> inner(64 + size);
  for (int i = 0; i < 64; ++i) inner[i] = block[i] ^ 0x36;
  if (size) std::memcpy(inner.data() + 64, data, size);
  const Sha256Digest inner_digest = sha256(inner.data(), inner.size());
  uint8_t outer[64 + 32];
  for (int i = 0; i < 64; ++i) outer[i] = block[i] ^ 0x5c;
  std::memcpy(outer + 64, inner_digest.data(), inner_digest.size());
  return sha256(outer, sizeof(outer));
}

AdmissionChallenge make_admission_challenge() {
  AdmissionChallenge challenge;
  std::memset(&challenge, 0, sizeof(challenge));
  challenge.magic = kAdmissionMagic;
  challenge.version = kAdmissionVersion;
  size_t got = 0;
  while (got < kAdmissionNonceBytes) {
    const ssize_t n = ::getrandom(challenge.nonce + got, kAdmissionNonceBytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  return challenge;
}

AdmissionProof prove_admission(const AdmissionChallenge& challenge, const std::string& secret,
                               const std::string& job_id) {
  AdmissionProof proof;
  std::memset(&proof, 0, sizeof(proof));
  proof.magic = kAdmissionMagic;
  proof.version = kAdmissionVersion;
  const std::vector<uint8_t> bytes = signed_bytes(challenge, job_id);
  const Sha256Digest mac = hmac_sha256(secret, bytes.data(), bytes.size());
  std::memcpy(proof.mac, mac.data(), mac.size());
  return proof;
}

std::string check_admission_challenge(const AdmissionChallenge& challenge) {
  if (challenge.magic != kAdmissionMagic) return "not a megatron_app listener (bad challenge magic)";
  if (challenge.version != kAdmissionVersion) {
    return "admission version " + std::to_string(challenge.version) + " != ours (" +
           std::to_string(kAdmissionVersion) + ")";
  }
  return "";
}

std::string check_admission(const AdmissionChallenge& challenge, const AdmissionProof& proof,
                            const std::string& secret, const std::string& job_id) {
  if (proof.magic != kAdmissionMagic) return "not a megatron_app transport connection (bad magic)";
  if (proof.version != kAdmissionVersion) {
    return "admission version " + std::to_string(proof.version) + " != ours (" + std::to_string(kAdmissionVersion) +
           ")";
  }
  const AdmissionProof expected = prove_admission(challenge, secret, job_id);
  uint8_t difference = 0;  // every byte compared: the time taken says nothing about where a guess went wrong
  for (size_t i = 0; i < kAdmissionMacBytes; ++i) difference |= expected.mac[i] ^ proof.mac[i];
  if (difference != 0) return "the job's secret was not proven";
  return "";
}

void answer_admission(int fd, const std::string& secret, const std::string& job_id, double timeout_s) {
  AdmissionChallenge challenge;
  auto* cursor = reinterpret_cast<uint8_t*>(&challenge);
  size_t got = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (got < sizeof(challenge)) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                            std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      throw std::runtime_error("the listener sent no admission challenge within " + std::to_string(timeout_s) +
                               " s");
    }
    pollfd wait{fd, POLLIN, 0};
    const int ready = ::poll(&wait, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno != EINTR) throw std::runtime_error(std::string("poll: ") + std::strerror(errno));
    if (ready <= 0) continue;
    const ssize_t n = ::recv(fd, cursor + got, sizeof(challenge) - got, MSG_DONTWAIT);
    if (n == 0) throw std::runtime_error("the listener closed the connection before its admission challenge");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw std::runtime_error(std::string("reading the admission challenge: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  const std::string problem = check_admission_challenge(challenge);
  if (!problem.empty()) throw std::runtime_error(problem);
  const AdmissionProof proof = prove_admission(challenge, secret, job_id);
  const auto* bytes = reinterpret_cast<const uint8_t*>(&proof);
  size_t sent = 0;
  while (sent < sizeof(proof)) {
    const ssize_t n = ::send(fd, bytes + sent, sizeof(proof) - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("writing the admission proof: ") + std::strerror(errno));
    }
    sent += static_cast<size_t>(n);
  }
}

}  // namespace mapp
