package tokensvc

import (
	"errors"
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorDomain is the google.rpc.ErrorInfo domain of every error tokensvc sends.
const ErrorDomain = "tokensvc.ctxmesh.ai"

// Error is a call that tokensvc or the transport failed: its gRPC code and, when tokensvc's handlers sent it, the ErrorInfo
// reason (a tokensvc.v1.ErrorReason name without its ERROR_REASON_ prefix, for example
// "BINDING_MISMATCH") and the request field it names. Branch on Code, Reason and Field, never on
// Message. An error without a Reason never reached tokensvc's handlers: the transport, a TLS
// handshake or the caller's own deadline ended it (docs/api.md, "Errors").
type Error struct {
	Code      codes.Code
	Message   string
	Reason    string            // "" when the status carried no ErrorInfo
	Field     string            // the offending request field's path, for field errors
	RequestID string            // the id on the server's log line for the call
	Metadata  map[string]string // the ErrorInfo metadata, whole
	status    *status.Status
}

func (e *Error) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("tokensvc: %s: %s", e.Code, e.Message)
	}
	return fmt.Sprintf("tokensvc: %s (%s): %s", e.Code, e.Reason, e.Message)
}

// GRPCStatus lets status.FromError and status.Code read an *Error as the status it came from.
func (e *Error) GRPCStatus() *status.Status {
	if e.status == nil {
		return status.New(e.Code, e.Message)
	}
	return e.status
}

// Retryable says whether the same call may succeed later: UNAVAILABLE (tokensvc's database or
// embedder, or the connection) and RESOURCE_EXHAUSTED without a reason, a server's overload.
func (e *Error) Retryable() bool {
	return e.Code == codes.Unavailable || (e.Code == codes.ResourceExhausted && e.Reason == "")
}

// AsError returns err's *Error, if it is or wraps one.
func AsError(err error) (*Error, bool) {
	var e *Error
	ok := errors.As(err, &e)
	return e, ok
}

// ReasonOf is err's ErrorInfo reason, or "" when it has none.
func ReasonOf(err error) string {
	if e, ok := AsError(err); ok {
		return e.Reason
	}
	return ""
}

// fromError turns a gRPC failure into an *Error; nil, io.EOF and errors that carry no gRPC
// status pass through unchanged.
func fromError(err error) error {
	if err == nil {
		return nil
	}
	if _, already := err.(*Error); already {
		return err
	}
	s, ok := status.FromError(err)
	if !ok {
		return err
	}
	e := &Error{Code: s.Code(), Message: s.Message(), status: s}
	for _, detail := range s.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			if d.GetDomain() == ErrorDomain {
				e.Reason = d.GetReason()
				e.Metadata = d.GetMetadata()
				if field := d.GetMetadata()["field"]; field != "" {
					e.Field = field
				}
				e.RequestID = d.GetMetadata()["request_id"]
			}
		case *errdetails.BadRequest:
			if violations := d.GetFieldViolations(); e.Field == "" && len(violations) > 0 {
				e.Field = violations[0].GetField()
			}
		}
	}
	return e
}
