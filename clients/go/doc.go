// Package tokensvc is the Go client of tokensvc, the ctxmesh token and long-term memory service,
// for launchers and controllers.
//
// A Client dials tokensvc over mutual TLS (PEM files, or any credentials.TransportCredentials such
// as a SPIFFE workload-API source), attaches the run capability to every call as
// `authorization: Bearer <capability>` (only on TLS connections), gives every unary call a
// default deadline, retries idempotent calls on UNAVAILABLE through the channel's service config,
// and turns every failed call into an *Error carrying the gRPC code and the google.rpc.ErrorInfo
// reason and field (the table in docs/api.md, "Errors"). Errors found before a call is made (a
// Config without certificates, an unreadable file) are plain errors.
//
// The generated stubs are in the gen/tokensvc/v1 package (`buf generate` from the repository's
// protos/); Client exposes them as Memory, Knowledge, Capability and the others, and adds
// UploadDocument, which streams a document from an io.Reader. example_test.go shows the calls a
// launcher makes: Remember, SearchMemories, SearchKnowledge, DeriveSessionKey.
package tokensvc
