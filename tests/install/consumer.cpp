// Calls the installed flashmsa API: a bad top_k must be refused with an error naming the argument.
#include <cstdio>

#include "flashmsa/api.h"

int main() {
  flashmsa::SelectParams params;
  params.shape.batch = 1;
  params.shape.seqlen = 256;
  params.shape.num_heads = 4;
  params.shape.num_kv_heads = 1;
  params.shape.num_proxy_heads = 1;
  params.shape.num_proxy_kv_heads = 1;
  params.shape.top_k = 0;
  const flashmsa::Status status = flashmsa::validate(params);
  std::printf("consumer: %s\n", status.message.c_str());
  return (!status.ok() && status.message.find("top_k") != std::string::npos) ? 0 : 1;
}
