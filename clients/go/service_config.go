package tokensvc

// serviceConfig retries the calls that are safe to send again on UNAVAILABLE, with backoff: reads,
// derivations, searches and the writes whose repetition changes nothing (RevokeCapability,
// ReloadTrustBundle, EraseEndUser); the same set as the Python client's (tokensvc/client.py).
// Remember is not in it: it is safe to send again only when every item carries an idempotency
// key, which only the caller knows. grpc-go before 1.40 applies a retry policy only with
// GRPC_GO_RETRY=on in the process's environment (read when the program starts).
const serviceConfig = `{
  "methodConfig": [{
    "name": [
      {"service": "tokensvc.v1.CapabilityService", "method": "VerifyCapability"},
      {"service": "tokensvc.v1.CapabilityService", "method": "DeriveSessionKey"},
      {"service": "tokensvc.v1.CapabilityService", "method": "RevokeCapability"},
      {"service": "tokensvc.v1.MemoryService", "method": "SearchMemories"},
      {"service": "tokensvc.v1.MemoryService", "method": "GetMemory"},
      {"service": "tokensvc.v1.MemoryService", "method": "ListMemories"},
      {"service": "tokensvc.v1.KnowledgeService", "method": "GetKnowledgeBase"},
      {"service": "tokensvc.v1.KnowledgeService", "method": "ListKnowledgeBases"},
      {"service": "tokensvc.v1.KnowledgeService", "method": "GetDocument"},
      {"service": "tokensvc.v1.KnowledgeService", "method": "ListDocuments"},
      {"service": "tokensvc.v1.KnowledgeService", "method": "SearchKnowledge"},
      {"service": "tokensvc.v1.AdminService", "method": "GetCredentialStatus"},
      {"service": "tokensvc.v1.AdminService", "method": "ListAuditEvents"},
      {"service": "tokensvc.v1.AdminService", "method": "ReloadTrustBundle"},
      {"service": "tokensvc.v1.DataSubjectService", "method": "EraseEndUser"},
      {"service": "tokensvc.v1.DataSubjectService", "method": "GetErasureReceipt"}
    ],
    "retryPolicy": {
      "maxAttempts": 4,
      "initialBackoff": "0.1s",
      "maxBackoff": "2s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}`
