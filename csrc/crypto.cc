// libcrypto's HMAC-SHA256, loaded at run time (crypto.h).
#include "crypto.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace bps {
namespace {

// libcrypto's functions we call (OpenSSL 1.1 and 3 export all three with these signatures)
struct CryptoApi {
  const void* (*EVP_sha256)();
  unsigned char* (*HMAC)(const void* md, const void* key, int key_len, const unsigned char* d,
                         std::size_t n, unsigned char* out, unsigned int* out_len);
  int (*CRYPTO_memcmp)(const void* a, const void* b, std::size_t len);
};

// OpenSSL 3 (Debian 12+, Ubuntu 22.04+), then 1.1, then the development link
constexpr const char* kDefaultNames = "libcrypto.so.3:libcrypto.so.1.1:libcrypto.so";

std::mutex g_mu;
std::string g_names = kDefaultNames;
bool g_tried = false;
CryptoApi g_api{};
std::string g_err;

// dlopen the first of g_names that has every function (g_mu held).
bool load_locked() {
  if (g_tried) return g_err.empty();
  g_tried = true;
  std::string tried;
  for (std::size_t at = 0; at <= g_names.size();) {
    std::size_t end = g_names.find(':', at);
    if (end == std::string::npos) end = g_names.size();
    const std::string name = g_names.substr(at, end - at);
    at = end + 1;
    if (name.empty()) continue;
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      tried += (tried.empty() ? "" : "; ") + std::string(dlerror());
      continue;
    }
    CryptoApi api{};
    api.EVP_sha256 = reinterpret_cast<decltype(api.EVP_sha256)>(dlsym(h, "EVP_sha256"));
    api.HMAC = reinterpret_cast<decltype(api.HMAC)>(dlsym(h, "HMAC"));
    api.CRYPTO_memcmp = reinterpret_cast<decltype(api.CRYPTO_memcmp)>(dlsym(h, "CRYPTO_memcmp"));
    if (api.EVP_sha256 && api.HMAC && api.CRYPTO_memcmp) {
      g_api = api;
      g_err.clear();
      return true;
    }
    tried += (tried.empty() ? "" : "; ") + name + " lacks EVP_sha256, HMAC or CRYPTO_memcmp";
    dlclose(h);
  }
  g_err = "the data plane's authenticated handshake (a job secret: BYTEPS_AUTH_SECRET or "
          "BYTEPS_AUTH_SECRET_FILE) needs OpenSSL's libcrypto (libcrypto.so.3), which this process "
          "cannot load (" + tried + "): install it, e.g. `apt-get install libssl3` on "
          "Debian/Ubuntu (libssl3t64 on Debian 13 and Ubuntu 24.04; the `openssl` package "
          "brings it too), `dnf install openssl-libs` on Fedora/RHEL";
  return false;
}

CryptoApi api() {
  std::lock_guard<std::mutex> g(g_mu);
  if (!load_locked()) throw std::runtime_error(g_err);
  return g_api;
}

}  // namespace

bool crypto_available(std::string* err) {
  std::lock_guard<std::mutex> g(g_mu);
  const bool ok = load_locked();
  *err = g_err;
  return ok;
}

void require_crypto() { api(); }

void hmac_sha256(const void* key, std::size_t key_len, const void* msg, std::size_t msg_len,
                 std::uint8_t out[32]) {
  const CryptoApi a = api();
  if (key_len > 0x7fffffff) throw std::invalid_argument("hmac_sha256: a key over 2 GiB");
  unsigned int n = 0;
  if (!a.HMAC(a.EVP_sha256(), key, static_cast<int>(key_len),
              static_cast<const unsigned char*>(msg), msg_len, out, &n) || n != 32)
    throw std::runtime_error("libcrypto's HMAC-SHA256 failed");
}

bool equal_ct(const std::uint8_t* a, const std::uint8_t* b, std::size_t n) {
  return api().CRYPTO_memcmp(a, b, n) == 0;
}

std::string crypto_set_names(const std::string& names) {
  std::lock_guard<std::mutex> g(g_mu);
  std::string old = g_names;
  g_names = names.empty() ? kDefaultNames : names;
  g_tried = false;
  g_err.clear();
  g_api = CryptoApi{};
  return old;
}

}  // namespace bps
